"""What the orchestrators' admission webhooks and controllers refuse beyond their CRD schemas, ported from their source.

A manifest can validate against its CRD and still be refused: each project's validating webhook (and, for KubeRay, the
controller's own validation, which fails the RayJob at once) applies rules no schema states. This package ports the
rules that can apply to the kinds trl_ext ships (JobSet, Kubeflow Trainer's TrainJob and TrainingRuntime,
LeaderWorkerSet, KubeRay's RayJob), each a small function returning the controller's own message, with the file it
comes from, one module a project: jobset.py, trainer.py, lws.py, kuberay.py, on the apimachinery checks of k8s.py.
`refusals(doc)` dispatches on apiVersion and kind; `tests/test_admission.py` runs it on every manifest.

Read at the commits named in ../shared/crds/README.md (all present in the upstream histories):
    kubernetes-sigs/jobset   08dfbdfd682714a9ab929633eca8dc95315187e7
    kubeflow/trainer         8c0f5059bd51ec3ba6d6a6a7b2e1471de7bc13b3
    kubernetes-sigs/lws      060ab4da17eea1f0865fcbd3236bb1075e2cea32
    ray-project/kuberay      feeaf72facab4881ba2b179248bb67315634e229
plus k8s.io/apimachinery pkg/util/validation (the DNS-label, subdomain, label and path checks the webhooks call).

The defaults that a rule depends on are applied first, as the API server (CRD `default`s) and the defaulting webhooks
would; the feature gates are taken at their defaults (JobSet's InPlaceRestart and RestartJob off, KubeRay's
RayJobDeletionPolicy on, its NetworkPolicy, mTLS and history-server gates off). A few CEL rules of the CRDs
(x-kubernetes-validations, which the schema test in tests/test_examples.py does not evaluate) are ported too, cited
to the API types that declare them.

Not covered: rules that need the cluster's state (a referenced ClusterTrainingRuntime or PriorityClass existing, a
PersistentVolumeClaim that already exists, a TrainingRuntime in another namespace), rules only about updates
(immutability), the pod webhooks (they act on pods the controllers create), Kubernetes' own validation of the Jobs,
StatefulSets and pods generated (e.g. a podFailurePolicy needing restartPolicy Never), and the strategic merge of a
TrainJob's runtimePatches beyond names (the JobSet a TrainJob becomes is checked without its patches).
"""

from tests.admission import jobset, kuberay, lws, trainer

KINDS = {
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): jobset.jobset,
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): trainer.trainjob,
    ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime"): trainer.training_runtime,
    ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"): trainer.training_runtime,
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): lws.leaderworkerset,
    ("ray.io/v1", "RayJob"): kuberay.rayjob,
}


def refusals(doc: dict, runtimes: dict[tuple[str, str], dict] | None = None) -> list[str]:
    """What the admission webhooks (and KubeRay's controller) of a manifest's project refuse in it.

    Args:
        doc: one manifest document of a kind in `KINDS`.
        runtimes: (kind, name) -> the TrainingRuntime or ClusterTrainingRuntime documents a TrainJob may name; a
            TrainJob whose runtime is not among them is checked without it.

    Returns:
        The refusals, empty when the manifest is admitted.

    Raises:
        KeyError: for a kind this package does not know.
    """
    check = KINDS[(doc.get("apiVersion"), doc.get("kind"))]
    if check is trainer.trainjob:
        _, kind, name = trainer.runtime_ref(doc)
        return trainer.trainjob(doc, (runtimes or {}).get((kind, name)))
    return check(doc)
