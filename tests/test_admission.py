"""The shipped Kubernetes manifests pass the orchestrators' admission rules, not only their CRD schemas.

tests/admission/ ports the rules of JobSet's, Kubeflow Trainer's, LeaderWorkerSet's and KubeRay's webhooks (and
KubeRay's controller validation, and a few CEL rules of the CRDs) from their source. Here: every JobSet, TrainJob,
TrainingRuntime, LeaderWorkerSet and RayJob document of examples/kubernetes (the files docs/*.md include) is refused by
none of them; each TrainJob names a runtime shipped beside it, so the rules that need the runtime run too; and each
ported rule refuses a small mutation of one of those manifests, with the controller's message, so that every rule is
shown to bite. Each case's id names the upstream file and the ported function. Pure Python, about a second.
"""

import copy
import functools
import inspect
import re

import pytest

from tests import admission
from tests.admission import jobset, kuberay, lws, refusals, trainer
from tests.test_examples import all_documents

MANIFESTS = [(name, doc) for name, doc in all_documents() if (doc["apiVersion"], doc["kind"]) in admission.KINDS]


def runtimes_of(docs) -> dict[tuple[str, str], dict]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs if doc["kind"] in trainer.RUNTIME_KINDS}


@functools.cache
def _shipped() -> dict[str, dict]:
    by_kind = {}
    for _, doc in MANIFESTS:
        assert doc["kind"] not in by_kind, "one manifest of each kind: the mutations below name it by kind"
        by_kind[doc["kind"]] = doc
    return by_kind


@pytest.mark.parametrize("name,doc", MANIFESTS, ids=[name for name, _ in MANIFESTS])
def test_shipped_manifest_is_admitted(name, doc):
    assert refusals(doc, runtimes_of(d for _, d in MANIFESTS)) == []


def test_every_trainjob_names_a_shipped_runtime():
    # so the rules that read the runtime (runtimePatches, torch envs, the JobSet it becomes) ran above
    runtimes = runtimes_of(d for _, d in MANIFESTS)
    trainjobs = [doc for _, doc in MANIFESTS if doc["kind"] == "TrainJob"]
    assert trainjobs
    for doc in trainjobs:
        assert trainer.runtime_ref(doc)[1:] in runtimes


def test_shipped_kinds_are_all_checked():
    assert {doc["kind"] for _, doc in MANIFESTS} == {"JobSet", "TrainingRuntime", "TrainJob", "LeaderWorkerSet",
                                                     "RayJob"}


# --- mutations ----------------------------------------------------------------------------------------------------


def _walk(doc, path):
    for key in path:
        doc = doc[key] if isinstance(key, int) else doc.setdefault(key, {})
    return doc


def put(kind, path, value):
    """Set `value` at `path` (keys and list indices) in the shipped document of `kind`."""
    def mutate(docs):
        _walk(docs[kind], path[:-1])[path[-1]] = copy.deepcopy(value)
    return mutate


def add(kind, path, value):
    """Append `value` to the list at `path`; a callable value is given the document."""
    def mutate(docs):
        _walk(docs[kind], path[:-1]).setdefault(path[-1], []).append(
            value(docs[kind]) if callable(value) else copy.deepcopy(value))
    return mutate


def drop(kind, path):
    def mutate(docs):
        del _walk(docs[kind], path[:-1])[path[-1]]
    return mutate


def both(*mutations):
    def mutate(docs):
        for mutation in mutations:
            mutation(docs)
    return mutate


def upstream_file(rule) -> str:
    """The upstream file a ported rule cites in the comment above it (tests/admission/)."""
    return re.search(r"([\w.]+\.go)", inspect.getcomments(rule) or "").group(1)


def case(rule, kind, mutate, fragment, what):
    return pytest.param(rule, kind, mutate, fragment, id=f"{upstream_file(rule)}:{rule.__name__}:{what}")


JS, TR, TJ, LWS, RJ = "JobSet", "TrainingRuntime", "TrainJob", "LeaderWorkerSet", "RayJob"
JOB = ("spec", "replicatedJobs", 0)
RULES = ("spec", "failurePolicy", "rules")
RT_JOB = ("spec", "template", "spec", "replicatedJobs", 0)
RT_RULES = ("spec", "template", "spec", "failurePolicy", "rules")
PATCH = ("spec", "runtimePatches", 0, "trainingRuntimeSpec", "template", "spec", "replicatedJobs", 0)
PATCH_POD = PATCH + ("template", "spec", "template", "spec")
TORCH = ("spec", "mlPolicy", "torch")
LWT = ("spec", "leaderWorkerTemplate")
ROLLING = ("spec", "rolloutStrategy")
RC = ("spec", "rayClusterSpec")
HEAD = RC + ("headGroupSpec",)
HEAD_POD = HEAD + ("template", "spec")
HEAD_ENV = HEAD_POD + ("containers", 0, "env")
WORKER = RC + ("workerGroupSpecs", 0)


def second_job(depends_on):
    """A second replicatedJob, a copy of the first, depending on `depends_on`."""
    def mutate(docs):
        rjob = copy.deepcopy(docs[JS]["spec"]["replicatedJobs"][0])
        rjob.update(name="later", dependsOn=[{"name": depends_on, "status": "Ready"}])
        docs[JS]["spec"]["replicatedJobs"].append(rjob)
    return mutate


def claim(name, mounted=True):
    """A volumeClaimPolicies template, mounted by the JobSet's trainer container."""
    template = {"metadata": {"name": name}, "spec": {"accessModes": ["ReadWriteOnce"],
                                                     "resources": {"requests": {"storage": "1Gi"}}}}
    mount = add(JS, JOB + ("template", "spec", "template", "spec", "containers", 0, "volumeMounts"),
                {"name": name, "mountPath": f"/mnt/{name}"})
    return both(add(JS, ("spec", "volumeClaimPolicies"), {"templates": [template]}), *([mount] if mounted else []))


def dataset_initializer_job(docs):
    rjob = copy.deepcopy(docs[TR]["spec"]["template"]["spec"]["replicatedJobs"][0])
    rjob["name"] = "dataset-initializer"
    rjob["template"]["metadata"]["labels"] = {trainer.ANCESTOR_LABEL: "dataset-initializer"}
    rjob["template"]["spec"]["template"]["spec"]["containers"] = [{"name": "dataset-initializer", "image": "x"}]
    docs[TR]["spec"]["template"]["spec"]["replicatedJobs"].append(rjob)


JOBSET_CASES = [
    case(jobset._in_place_restart_gate, JS, put(JS, ("spec", "failurePolicy", "restartStrategy"), "InPlaceRestart"),
         "InPlaceRestart feature gate is disabled", "gate-off"),
    case(jobset._first_depends_on, JS, put(JS, JOB + ("dependsOn",), [{"name": "workers", "status": "Ready"}]),
         "DependsOn can't be set for the first ReplicatedJob", "first"),
    case(jobset._subdomain, JS, put(JS, ("spec", "network", "subdomain"), "Dpo"), "a DNS-1035 label", "uppercase"),
    case(jobset._subdomain, JS, put(JS, ("spec", "network", "subdomain"), "s" * 64),
         ".spec.network.subdomain is too long", "64-chars"),
    case(jobset._managed_by, JS, put(JS, ("spec", "managedBy"), "kueue"),
         "must be a domain-prefixed path", "no-domain"),
    case(jobset._replicated_job_names_unique, JS, add(JS, ("spec", "replicatedJobs"),
                                                      lambda doc: copy.deepcopy(doc["spec"]["replicatedJobs"][0])),
         'Duplicate value: {"name":"workers"}', "listType-map"),
    case(jobset._replicas_times_parallelism, JS, put(JS, JOB + ("template", "spec", "parallelism"), 2**31 - 1),
         "the product of replicas and parallelism must not exceed 2147483647", "overflow"),
    case(jobset._group_names, JS, put(JS, JOB + ("groupName",), "Workers"), "a DNS-1035 label", "uppercase"),
    case(jobset._depends_on_earlier, JS, second_job("nope"),
         "replicatedJob: later cannot depend on replicatedJob: nope", "unknown"),
    case(jobset._success_targets, JS, put(JS, ("spec", "successPolicy"), {"operator": "All",
                                                                         "targetReplicatedJobs": ["nope"]}),
         "invalid replicatedJob name 'nope' does not appear in .spec.ReplicatedJobs", "unknown"),
    case(jobset._restart_job_gate, JS, put(JS, RULES + (0, "action"), "RestartJob"),
         "not allowed when RestartJob feature gate is disabled", "gate-off"),
    case(jobset._failure_rule_names, JS, put(JS, RULES + (0, "name"), "the-runs-own-error"),
         "invalid failure policy rule name 'the-runs-own-error'", "ruleNameFmt-hyphen"),
    case(jobset._failure_rule_names, JS, put(JS, RULES + (0, "name"), "r" * 129),
         "invalid failure policy rule name of length 129", "length"),
    case(jobset._failure_rule_names, JS,
         add(JS, RULES, lambda doc: copy.deepcopy(doc["spec"]["failurePolicy"]["rules"][0])),
         "rule names are not unique, rules with indices [0 1] all have the same name 'the_runs_own_error'", "unique"),
    case(jobset._failure_rule_targets, JS, put(JS, RULES + (0, "targetReplicatedJobs"), ["nope"]),
         "invalid replicatedJob name 'nope' in failure policy does not appear", "unknown"),
    case(jobset._failure_rule_reasons, JS, put(JS, RULES + (0, "onJobFailureReasons"), ["OOMKilled"]),
         "invalid job failure reason 'OOMKilled' in failure policy is not a recognized job failure reason", "unknown"),
    case(jobset._coordinator, JS, put(JS, ("spec", "coordinator"), {"replicatedJob": "nope"}),
         "coordinator replicatedJob nope does not exist", "unknown-job"),
    case(jobset._coordinator, JS, put(JS, ("spec", "coordinator"), {"replicatedJob": "workers", "jobIndex": 2}),
         "coordinator job index 2 is invalid for replicatedJob workers", "job-index"),
    case(jobset._coordinator, JS, put(JS, ("spec", "coordinator"), {"replicatedJob": "workers", "podIndex": 1}),
         "coordinator pod index 1 is invalid for replicatedJob workers job index 0", "pod-index"),
    case(jobset._coordinator_label, JS, both(put(JS, ("spec", "network", "subdomain"), "s" * 50),
                                             put(JS, ("spec", "coordinator"), {"replicatedJob": "workers"})),
         'for coordinator label "jobset.sigs.k8s.io/coordinator"', "too-long"),
    case(jobset._volume_claim_policies, JS, both(claim("data"), claim("data")),
         "data: names must be unique for VolumeClaimPolicies template", "unique"),
    case(jobset._volume_claim_policies, JS, claim("Data"), "a lowercase RFC 1123 subdomain", "uppercase"),
    case(jobset._volume_claim_mounts, JS, claim("data", mounted=False),
         "replicatedJob containers don't have a matching volumeMount: data from VolumeClaimPolicies", "unmounted"),
    case(jobset._volume_claim_mounts, JS, claim("shared"),
         "volume name conflicts with VolumeClaimPolicy template name: shared", "volume-conflict"),
    case(jobset._volume_claim_name_lengths, JS, claim("d" * 60), "VolumeClaimPolicies template name is too long",
         "pvc-name"),
    case(jobset._startup_policy_excludes_depends_on, JS,
         both(second_job("workers"), put(JS, ("spec", "startupPolicy"), {"startupPolicyOrder": "InOrder"})),
         "StartupPolicy and DependsOn APIs are mutually exclusive", "InOrder"),
    case(jobset._generated_job_names, JS, put(JS, ("metadata", "name"), "d" * 60),
         "job names generated for this JobSet will exceed 63 characters", "long-name"),
    # 50 characters of name: its last Job, <name>-workers-1, has 60, that Job's pod, <name>-workers-1-0-abcde, 68
    case(jobset._generated_pod_names, JS, put(JS, ("metadata", "name"), "d" * 50),
         "pod names generated for this JobSet will exceed 63 characters", "long-name"),
]

TRAINER_CASES = [
    case(trainer._ancestor_replicas, TR, put(TR, RT_JOB + ("replicas",), 2),
         "spec.template.spec.replicatedJobs[0].replicas: always must be 1", "trainer"),
    case(trainer._ancestor_containers, TR, put(TR, RT_JOB + ("template", "spec", "template", "spec", "containers", 0,
                                                            "name"), "trainer"),
         "must contain the required container for the ancestor: trainer", "no-node"),
    case(trainer._one_ml_policy, TR, put(TR, ("spec", "mlPolicy", "mpi"), {}),
         "Only one of the policy can be configured", "torch-and-mpi"),
    case(trainer._env_injection_not_node, TR,
         put(TR, TORCH + ("envInjection",), {"targets": [{"jobName": "node", "containerNames": ["node"]}]}),
         "containerNames must not include the main node container", "node"),
    case(jobset._failure_rule_names, TR, put(TR, RT_RULES + (0, "name"), "the-runs-own-error"),
         "its JobSet: invalid failure policy rule name 'the-runs-own-error'", "runtime-template"),
    case(trainer._trainjob_name, TJ, put(TJ, ("metadata", "name"), "DPO"),
         "metadata.name must match RFC 1035 DNS label format", "uppercase"),
    case(trainer._trainjob_name, TJ, put(TJ, ("metadata", "name"), "d" * 64), "metadata.name must be no more than 63",
         "64-chars"),
    case(trainer._num_proc_per_node, TJ, put(TJ, ("spec", "trainer", "numProcPerNode"), 0),
         "numProcPerNode must be greater than or equal to 1", "zero"),
    case(trainer._trainjob_managed_by, TJ, put(TJ, ("spec", "managedBy"), "me"),
         "ManagedBy must be trainer.kubeflow.org/trainjob-controller or kueue.x-k8s.io/multikueue", "other"),
    case(trainer._runtime_kind, TJ, put(TJ, ("spec", "runtimeRef", "kind"), "Runtime"),
         "unsupported runtime: Runtime.trainer.kubeflow.org", "kind"),
    case(trainer._patch_managers, TJ, put(TJ, ("spec", "runtimePatches", 0, "manager"), "shared-volume"),
         'spec.runtimePatches.manager: must be a domain-prefixed path (such as "acme.io/foo")', "no-domain"),
    case(trainer._patch_targets, TJ, put(TJ, PATCH + ("name",), "trainer"),
         "must not have replicated job that doesn't exist in the runtime job template", "job"),
    case(trainer._patch_targets, TJ, put(TJ, PATCH_POD + ("containers", 0, "name"), "sidecar"),
         "must not have container that doesn't exist in the runtime job node", "container"),
    case(trainer._patch_targets, TJ, put(TJ, PATCH_POD + ("initContainers",), [{"name": "fetch"}]),
         "must not have initContainer that doesn't exist in the runtime job node", "initContainer"),
    case(trainer._patch_envs, TJ, put(TJ, PATCH_POD + ("containers", 0, "env"), [{"name": "HF_HOME", "value": "/x"}]),
         "must not have envs for the dataset-initializer, model-initializer, node containers", "node-env"),
    case(trainer._initializer_jobs, TJ, put(TJ, ("spec", "initializer"), {"dataset": {"storageUri": "hf://d"}}),
         "must have dataset-initializer job when trainJob is configured with input datasetConfig", "no-job"),
    case(trainer._initializer_jobs, TJ, both(dataset_initializer_job,
                                             put(TR, RT_JOB[:-1] + (1, "template", "spec", "template", "spec",
                                                                    "containers", 0, "name"), "fetch"),
                                             put(TJ, ("spec", "initializer"), {"dataset": {"storageUri": "hf://d"}})),
         "must have container with name - dataset-initializer in the dataset-initializer job", "no-container"),
    case(trainer._initializer_jobs, TJ, both(dataset_initializer_job,
                                             put(TJ, ("spec", "initializer"), {"dataset": {"storageUri": "hf://d"}})),
         "must have volumeMount with name - initializer in container dataset-initializer", "no-mount"),
    case(trainer._torch_reserved_envs, TJ, put(TJ, ("spec", "trainer", "env"), [{"name": "PET_NNODES", "value": "4"}]),
         "must not have reserved envs, invalid envs configured: [PET_NNODES]", "PET_NNODES"),
    case(trainer._torch_env_injection_targets, TJ,
         put(TR, TORCH + ("envInjection",), {"targets": [{"jobName": "node", "containerNames": ["preflight"]}]}),
         'envInjection target podSet "node" container "preflight" not found in runtime template', "absent"),
    # a TrainJob of 50 characters: its JobSet's second pod (2 nodes), <name>-node-0-1-abcde, has 65
    case(jobset._generated_pod_names, TJ, put(TJ, ("metadata", "name"), "d" * 50),
         "its JobSet: spec.replicatedJobs[0].name: JobSet name is too long, pod names generated", "trainjob-name"),
    case(jobset._failure_rule_names, TJ, put(TR, RT_RULES + (0, "name"), "the-runs-own-error"),
         "its JobSet: invalid failure policy rule name 'the-runs-own-error'", "runtime-rule"),
]

LWS_CASES = [
    case(lws._lws_name, LWS, put(LWS, ("metadata", "name"), "DPO"), "metadata.name: a DNS-1035 label", "uppercase"),
    case(lws._lws_replicas, LWS, put(LWS, ("spec", "replicas"), -1), "replicas must be equal or greater than 0",
         "negative"),
    case(lws._lws_replicas, LWS, put(LWS, ("spec", "replicas"), 1000001), "replicas must be equal or less than 1000000",
         "too-many"),
    case(lws._lws_size, LWS, put(LWS, LWT + ("size",), 0), "size must be equal or greater than 1", "zero"),
    case(lws._lws_pods, LWS, both(put(LWS, ("spec", "replicas"), 1000000), put(LWS, LWT + ("size",), 10000)),
         "the product of replicas and worker replicas must not exceed 2147483647", "overflow"),
    case(lws._lws_rolling_update, LWS, put(LWS, ROLLING, {"rollingUpdateConfiguration": {"maxUnavailable": "150%"}}),
         "maxUnavailable: must not be greater than 100%", "150%"),
    case(lws._lws_rolling_update, LWS, put(LWS, ROLLING, {"rollingUpdateConfiguration": {"maxSurge": "one"}}),
         "maxSurge: a valid percent string must be a numeric string followed by an ending '%'", "not-percent"),
    case(lws._lws_rolling_update, LWS, put(LWS, ROLLING, {"rollingUpdateConfiguration": {"partition": -1}}),
         "partition: must be greater than or equal to 0", "partition"),
    # 50% of 1 replica rounds down to 0 unavailable, with the default 0 surge: a rollout could never progress
    case(lws._lws_rollout_progresses, LWS, put(LWS, ROLLING, {"rollingUpdateConfiguration": {"maxUnavailable": "50%"}}),
         "maxUnavailable: must not be 0 when `maxSurge` is 0", "50%-of-1"),
    case(lws._lws_subgroups, LWS, put(LWS, LWT + ("subGroupPolicy",), {"subGroupSize": 0}),
         "subGroupSize must be equal or greater than 1", "zero"),
    case(lws._lws_subgroups, LWS, put(LWS, LWT + ("subGroupPolicy",), {"subGroupSize": 3}),
         "subGroupSize cannot be larger than size", "larger"),
    case(lws._lws_subgroups, LWS, both(put(LWS, LWT + ("size",), 5), put(LWS, LWT + ("subGroupPolicy",),
                                                                         {"subGroupSize": 3})),
         "size or size - 1 must be divisible by subGroupSize", "divisible"),
    case(lws._lws_subgroups, LWS, put(LWS, LWT + ("subGroupPolicy",), {"subGroupSize": 2, "type": "LeaderExcluded"}),
         "size-1 must be divisible by subGroupSize when using LeaderExcluded", "LeaderExcluded"),
    case(lws._lws_subgroup_annotation, LWS, put(LWS, ("metadata", "annotations"), {lws.SUBGROUP_EXCLUSIVE: "x"}),
         "cannot have subgroup-exclusive-topology without subGroupSize set", "annotation"),
]

SELECTOR = {"ray.io/cluster": "raycluster"}
NO_SHUTDOWN = (drop(RJ, ("spec", "shutdownAfterJobFinishes")), drop(RJ, ("spec", "ttlSecondsAfterFinished")))
RAY_CASES = [
    case(kuberay._rayjob_name, RJ, put(RJ, ("metadata", "name"), "d" * 48), "RayJob name should be no more than 47",
         "48-chars"),
    case(kuberay._rayjob_name, RJ, put(RJ, ("metadata", "name"), "DPO"), "RayJob name should be a valid DNS1035 label",
         "uppercase"),
    case(kuberay._rayjob_lifecycle, RJ, both(put(RJ, ("spec", "suspend"), True), *NO_SHUTDOWN),
         "a RayJob with shutdownAfterJobFinishes set to false is not allowed to be suspended", "suspend"),
    case(kuberay._rayjob_lifecycle, RJ, put(RJ, ("spec", "ttlSecondsAfterFinished"), -1),
         "TTLSecondsAfterFinished must be a non-negative integer", "negative-ttl"),
    case(kuberay._rayjob_lifecycle, RJ, put(RJ, ("spec", "shutdownAfterJobFinishes"), False),
         "a RayJob with shutdownAfterJobFinishes set to false cannot have TTLSecondsAfterFinished", "ttl-no-shutdown"),
    case(kuberay._rayjob_lifecycle, RJ, both(put(RJ, ("spec", "suspend"), True), put(RJ, ("spec", "clusterSelector"),
                                                                                     SELECTOR)),
         "the ClusterSelector mode doesn't support the suspend operation", "selector-suspend"),
    case(kuberay._rayjob_lifecycle, RJ, drop(RJ, RC),
         "one of RayClusterSpec or ClusterSelector must be set", "no-cluster"),
    case(kuberay._rayjob_lifecycle, RJ, put(RJ, ("spec", "activeDeadlineSeconds"), 0),
         "activeDeadlineSeconds must be a positive integer", "activeDeadline"),
    case(kuberay._rayjob_lifecycle, RJ, put(RJ, ("spec", "preRunningDeadlineSeconds"), 0),
         "preRunningDeadlineSeconds must be a positive integer", "preRunningDeadline"),
    case(kuberay._rayjob_lifecycle, RJ, put(RJ, ("spec", "backoffLimit"), -1),
         "backoffLimit must be a positive integer", "backoffLimit"),
    case(kuberay._rayjob_deletion_strategy, RJ, put(RJ, ("spec", "deletionStrategy"), {
        "deletionRules": [{"policy": "DeleteCluster", "condition": {"jobStatus": "SUCCEEDED"}}]}),
         "spec.shutdownAfterJobFinishes and spec.deletionStrategy.deletionRules are mutually exclusive", "rules"),
    case(kuberay._rayjob_deletion_strategy, RJ, both(*NO_SHUTDOWN, put(RJ, ("spec", "deletionStrategy"), {
        "onSuccess": {"policy": "DeleteCluster"}, "onFailure": {"policy": "DeleteNone"},
        "deletionRules": [{"policy": "DeleteCluster", "condition": {"jobStatus": "SUCCEEDED"}}]})),
         "Cannot use both legacy onSuccess/onFailure fields and deletionRules", "legacy-and-rules"),
    case(kuberay._rayjob_deletion_strategy, RJ, put(RJ, ("spec", "deletionStrategy"), {}),
         "DeletionStrategy requires either BOTH onSuccess and onFailure", "empty"),
    case(kuberay._rayjob_cluster_selector, RJ, both(drop(RJ, RC), put(RJ, ("spec", "clusterSelector"),
                                                                      {"ray.io/cluster": ""})),
         "cluster name in ClusterSelector should not be empty", "empty"),
    case(kuberay._rayjob_cluster_selector, RJ, both(put(RJ, ("spec", "clusterSelector"), SELECTOR),
                                                    put(RJ, ("spec", "submissionMode"), "SidecarMode")),
         "ClusterSelector is not supported in SidecarMode", "sidecar"),
    case(kuberay._rayjob_cluster_selector, RJ, put(RJ, ("spec", "clusterSelector"), SELECTOR),
         "BackoffLimit is incompatible with ClusterSelector mode", "backoffLimit"),
    case(kuberay._rayjob_submission_mode, RJ, put(RJ, ("spec", "submissionMode"), "InteractiveMode"),
         "BackoffLimit is incompatible with InteractiveMode", "interactive"),
    case(kuberay._rayjob_submission_mode, RJ, both(put(RJ, ("spec", "submissionMode"), "SidecarMode"),
                                                   put(RJ, ("spec", "submitterPodTemplate"),
                                                       {"spec": {"containers": []}})),
         "Currently, SidecarMode doesn't support SubmitterPodTemplate", "submitterPodTemplate"),
    case(kuberay._rayjob_submission_mode, RJ, both(put(RJ, ("spec", "submissionMode"), "SidecarMode"),
                                                   put(RJ, ("spec", "submitterConfig"), {"backoffLimit": 1})),
         "Currently, SidecarMode doesn't support SubmitterConfig", "submitterConfig"),
    case(kuberay._rayjob_submission_mode, RJ, both(put(RJ, ("spec", "submissionMode"), "SidecarMode"),
                                                   put(RJ, HEAD_POD + ("restartPolicy",), "Always")),
         "restartPolicy for head Pod should be Never or unset when using SidecarMode", "sidecar-restart"),
    case(kuberay._rayjob_runtime_env, RJ, put(RJ, ("spec", "runtimeEnvYAML"), "- pip"),
         "failed to unmarshal RuntimeEnvYAML", "list"),
    case(kuberay._rayjob_k8s_auth, RJ, put(RJ, RC + ("authOptions",), {"mode": "token", "enableK8sTokenAuth": True}),
         "K8s token auth mode is currently not supported for RayJob", "k8s-token"),
    case(kuberay._cluster_containers, RJ, put(RJ, HEAD_POD + ("containers",), []),
         "headGroupSpec should have at least one container", "head"),
    case(kuberay._cluster_containers, RJ, put(RJ, WORKER + ("template", "spec", "containers"), []),
         "workerGroupSpec should have at least one container", "worker"),
    case(kuberay._group_resources_and_labels, RJ, put(RJ, HEAD + ("resources",), {"CPU": "0"}),
         "resource fields should not be set in both rayStartParams and Resources for Head group", "num-cpus"),
    case(kuberay._group_resources_and_labels, RJ, put(RJ, WORKER + ("rayStartParams",), {"labels": "gpu=1"}),
         "rayStartParams['labels'] is not supported for gpu group", "labels-param"),
    case(kuberay._group_resources_and_labels, RJ, put(RJ, WORKER + ("labels",), {"bad key": "x"}),
         "invalid label key for gpu group: 'bad key'", "label-key"),
    case(kuberay._group_resources_and_labels, RJ, put(RJ, WORKER + ("labels",), {"tier": "-x"}),
         "invalid label value for key 'tier' in gpu group: '-x'", "label-value"),
    case(kuberay._worker_replicas, RJ, drop(RJ, WORKER + ("maxReplicas",)),
         "worker group gpu must set both minReplicas and maxReplicas when autoscaling is disabled", "no-max"),
    case(kuberay._worker_replicas, RJ, put(RJ, WORKER + ("minReplicas",), -1),
         "worker group gpu has negative minReplicas -1", "negative-min"),
    case(kuberay._worker_replicas, RJ, both(put(RJ, WORKER + ("minReplicas",), 0),
                                            put(RJ, WORKER + ("maxReplicas",), -1)),
         "worker group gpu has negative maxReplicas -1", "negative-max"),
    case(kuberay._worker_replicas, RJ, put(RJ, WORKER + ("minReplicas",), 3),
         "worker group gpu has minReplicas 3 greater than maxReplicas 2", "min-above-max"),
    case(kuberay._worker_idle_timeout, RJ, put(RJ, WORKER + ("idleTimeoutSeconds",), 60),
         "worker group gpu: idleTimeoutSeconds is set, but autoscaler v2 is not enabled", "v1"),
    case(kuberay._worker_idle_timeout, RJ, put(RJ, WORKER + ("idleTimeoutSeconds",), -1),
         "worker group gpu: idleTimeoutSeconds must be non-negative, got -1", "negative"),
    case(kuberay._worker_priority, RJ, put(RJ, WORKER + ("priority",), 1),
         "worker group gpu: priority is set to 1, but autoscaler v2 is not enabled", "v1"),
    case(kuberay._worker_priority, RJ, both(put(RJ, WORKER + ("priority",), 1),
                                            put(RJ, RC + ("rayVersion",), "2.50.0")),
         "priority is set, but minimum Ray version is 2.56.0, got 2.50.0", "old-ray"),
    case(kuberay._worker_priority, RJ, both(put(RJ, WORKER + ("priority",), 1), drop(RJ, RC + ("rayVersion",))),
         "priority is set, but RayVersion was not specified", "no-version"),
    case(kuberay._gcs_fault_tolerance, RJ, both(put(RJ, ("metadata", "annotations"), {"ray.io/ft-enabled": "true"}),
                                                put(RJ, RC + ("gcsFaultToleranceOptions",),
                                                    {"redisAddress": "redis:6379"})),
         "ray.io/ft-enabled annotation and GcsFaultToleranceOptions are both set", "both"),
    case(kuberay._gcs_fault_tolerance, RJ, put(RJ, HEAD_ENV, [{"name": "RAY_REDIS_ADDRESS", "value": "redis:6379"}]),
         "RAY_REDIS_ADDRESS is set which implicitly enables GCS fault tolerance", "redis-env"),
    case(kuberay._gcs_fault_tolerance, RJ, put(RJ, HEAD + ("rayStartParams", "redis-username"), "ray"),
         "cannot set redis username in rayStartParams or environment variables", "redis-username"),
    case(kuberay._autoscaler, RJ, put(RJ, HEAD_ENV, [{"name": "RAY_enable_autoscaler_v2", "value": "true"}]),
         "environment variable RAY_enable_autoscaler_v2 cannot be set to 'true' when enableInTreeAutoscaling is false",
         "v2-env-without-autoscaling"),
    case(kuberay._autoscaler, RJ, both(put(RJ, RC + ("enableInTreeAutoscaling",), True),
                                       put(RJ, WORKER + ("suspend",), True)),
         "worker group gpu cannot be suspended with Autoscaler enabled", "suspend"),
    case(kuberay._autoscaler, RJ, both(put(RJ, RC + ("enableInTreeAutoscaling",), True),
                                       put(RJ, RC + ("autoscalerOptions",), {"version": "v2"}),
                                       put(RJ, HEAD_ENV, [{"name": "RAY_enable_autoscaler_v2", "value": "1"}])),
         "both .spec.autoscalerOptions.version and head Pod env var RAY_enable_autoscaler_v2 are set", "version-twice"),
    case(kuberay._autoscaler, RJ, both(put(RJ, RC + ("enableInTreeAutoscaling",), True),
                                       put(RJ, RC + ("autoscalerOptions",), {"version": "v2"}),
                                       put(RJ, HEAD_POD + ("restartPolicy",), "Always")),
         "restartPolicy for head Pod should be Never or unset when using autoscaler V2", "v2-restart"),
    case(kuberay._autoscaler, RJ, put(RJ, RC + ("autoscalerOptions",), {"idleTimeoutSeconds": -1}),
         "autoscalerOptions.idleTimeoutSeconds must be non-negative, got -1", "idle"),
    case(kuberay._autoscaler, RJ, put(RJ, RC + ("autoscalerOptions",), {
        "env": [{"name": "KUBERAY_GEN_AUTOSCALER_START_CMD", "value": "x"}]}),
         "autoscalerOptions.env must not contain KUBERAY_GEN_AUTOSCALER_START_CMD", "managed-env"),
    case(kuberay._auth, RJ, both(put(RJ, RC + ("authOptions",), {"mode": "token"}),
                                 put(RJ, RC + ("rayVersion",), "2.50.0")),
         "authOptions.mode is 'token' but minimum Ray version is 2.52.0, got 2.50.0", "old-ray"),
    case(kuberay._auth, RJ, both(put(RJ, RC + ("authOptions",), {"mode": "token"}), drop(RJ, RC + ("rayVersion",))),
         "authOptions.mode is 'token' but RayVersion was not specified", "no-version"),
    case(kuberay._auth, RJ, put(RJ, RC + ("authOptions",), {"enableK8sTokenAuth": True}),
         "authOptions.enableK8sTokenAuth is enabled but authOptions.mode not set to 'token'", "no-token"),
    case(kuberay._cluster_feature_gates, RJ, put(RJ, RC + ("networkPolicy",), {}),
         "spec.networkPolicy requires the RayClusterNetworkPolicy feature gate to be enabled", "networkPolicy"),
    case(kuberay._cluster_feature_gates, RJ, put(RJ, RC + ("tlsOptions",), {"enabled": True}),
         "spec.tlsOptions requires the RayClusterMTLS feature gate to be enabled", "tlsOptions"),
    case(kuberay._cluster_feature_gates, RJ, put(RJ, RC + ("historyServerOptions",), {}),
         "RayClusterHistoryServer feature gate is not enabled", "historyServer"),
    case(kuberay._worker_group_names_unique, RJ,
         add(RJ, RC + ("workerGroupSpecs",), lambda doc: copy.deepcopy(doc["spec"]["rayClusterSpec"]
                                                                       ["workerGroupSpecs"][0])),
         "spec.workerGroupSpecs[1]: worker group names must be unique", "duplicate"),
]

CASES = JOBSET_CASES + TRAINER_CASES + LWS_CASES + RAY_CASES


@pytest.mark.parametrize("rule,kind,mutate,fragment", CASES)
def test_rule_refuses_a_mutated_manifest(rule, kind, mutate, fragment):
    docs = copy.deepcopy(_shipped())
    mutate(docs)
    found = refusals(docs[kind], runtimes_of(docs.values()))
    assert any(fragment in message for message in found), found


def test_every_ported_rule_is_shown_to_bite():
    # the rules of each of the package's modules (k8s.py holds only the apimachinery checks they call)
    rules = (jobset.JOBSET_SPEC_RULES + jobset.JOBSET_NAMED_RULES + trainer.TRAINING_RUNTIME_RULES
             + trainer.TRAINJOB_RULES + trainer.TRAINJOB_RUNTIME_RULES + lws.LWS_RULES
             + kuberay.RAYJOB_SPEC_RULES + kuberay.RAYCLUSTER_SPEC_RULES + (kuberay._rayjob_name,))
    bitten = {param.values[0] for param in CASES}
    assert [rule.__name__ for rule in rules if rule not in bitten] == []
    # each cites where it comes from: owner/repo, then a .go file
    assert [rule.__name__ for rule in rules if not re.match(r"# [\w-]+/[\w-]+ \S+\.go", inspect.getcomments(rule)
                                                            or "")] == []
