"""Kubeflow Trainer's admission rules (kubeflow/trainer at 8c0f5059bd51ec3ba6d6a6a7b2e1471de7bc13b3): TrainingRuntime
(pkg/webhooks/trainingruntime_webhook.go, the CEL rules of pkg/apis/trainer/v1alpha1/trainingruntime_types.go),
TrainJob (pkg/webhooks/trainjob_webhook.go, the CEL rules of trainjob_types.go, and the Validate of the runtime plugins
it runs: pkg/runtime/framework/plugins/jobset/jobset.go, plugins/torch/torch.go), and the JobSet a TrainJob becomes
(plugins/jobset, core/trainingruntime.go), which JobSet's rules (jobset.py) then check.
"""

import copy

from tests.admission.jobset import jobset, jobset_spec
from tests.admission.k8s import DNS1035_LABEL, domain_prefixed_path, env_names, pod_spec

TRAINER_GROUP = "trainer.kubeflow.org"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"  # constants.LabelTrainJobAncestor
ANCESTOR_CONTAINERS = {"trainer": "node", "model-initializer": "model-initializer",
                       "dataset-initializer": "dataset-initializer"}  # expectedContainerNames
RUNTIME_KINDS = ("TrainingRuntime", "ClusterTrainingRuntime")  # pkg/runtime/core/registry.go: NewRuntimeRegistry
TORCH_RESERVED_ENVS = ("PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_NNODES", "PET_NODE_RANK",
                       "PET_NPROC_PER_NODE")  # constants.TorchRunReservedEnvNames, sorted as sets.List prints them
ML_POLICIES = ("torch", "mpi", "jax", "xgboost", "flux")


def _ancestor(rjob: dict) -> str | None:
    return (((rjob.get("template") or {}).get("metadata") or {}).get("labels") or {}).get(ANCESTOR_LABEL)


def _containers(rjob: dict) -> list[dict]:
    pod = pod_spec(((rjob.get("template") or {}).get("spec") or {}).get("template"))
    return (pod.get("initContainers") or []) + (pod.get("containers") or [])


def _runtime_rjobs(runtime: dict) -> list[dict]:
    return (((runtime.get("spec") or {}).get("template") or {}).get("spec") or {}).get("replicatedJobs") or []


# kubeflow/trainer pkg/webhooks/trainingruntime_webhook.go: validateReplicatedJobs (ancestor jobs: replicas 1)
def _ancestor_replicas(runtime: dict) -> list[str]:
    return [f"spec.template.spec.replicatedJobs[{i}].replicas: always must be 1"
            for i, rjob in enumerate(_runtime_rjobs(runtime))
            if _ancestor(rjob) in ANCESTOR_CONTAINERS and rjob.get("replicas", 1) != 1]  # CRD default: 1


# kubeflow/trainer pkg/webhooks/trainingruntime_webhook.go: validateReplicatedJobs (the ancestor's container)
def _ancestor_containers(runtime: dict) -> list[str]:
    errors = []
    for i, rjob in enumerate(_runtime_rjobs(runtime)):
        ancestor = _ancestor(rjob)
        pod = pod_spec(((rjob.get("template") or {}).get("spec") or {}).get("template"))
        names = {c.get("name") for c in pod.get("containers") or []}
        if ancestor in ANCESTOR_CONTAINERS and ANCESTOR_CONTAINERS[ancestor] not in names:
            errors.append(f"spec.template.spec.replicatedJobs[{i}].template.spec.template.spec.containers: must "
                          f"contain the required container for the ancestor: {ancestor}")
    return errors


# kubeflow/trainer pkg/apis/trainer/v1alpha1/trainingruntime_types.go: MLPolicySource CEL rule
def _one_ml_policy(runtime: dict) -> list[str]:
    ml_policy = (runtime.get("spec") or {}).get("mlPolicy") or {}
    return ["Only one of the policy can be configured"] if sum(p in ml_policy for p in ML_POLICIES) > 1 else []


# kubeflow/trainer pkg/apis/trainer/v1alpha1/trainingruntime_types.go: EnvInjectionTarget.containerNames CEL rule
def _env_injection_not_node(runtime: dict) -> list[str]:
    targets = ((((runtime.get("spec") or {}).get("mlPolicy") or {}).get("torch") or {}).get("envInjection")
               or {}).get("targets") or []
    return ["containerNames must not include the main node container because PET_* envs are always injected into it"
            for target in targets if "node" in (target.get("containerNames") or [])]


TRAINING_RUNTIME_RULES = (_ancestor_replicas, _ancestor_containers, _one_ml_policy, _env_injection_not_node)


def training_runtime(doc: dict) -> list[str]:
    """What Trainer's runtime webhook (pkg/webhooks/trainingruntime_webhook.go, the same for a ClusterTrainingRuntime)
    and CRD rules refuse, plus what JobSet's webhook would refuse in the JobSet of every TrainJob using the runtime
    (the rules that need no JobSet name), prefixed "its JobSet".

    Args:
        doc: a `trainer.kubeflow.org/v1alpha1` TrainingRuntime or ClusterTrainingRuntime.

    Returns:
        The refusals.
    """
    template = (((doc.get("spec") or {}).get("template") or {}).get("spec")) or {}
    return [message for rule in TRAINING_RUNTIME_RULES for message in rule(doc)] + [
        f"its JobSet: {message}" for message in jobset_spec(template, None)]


# kubeflow/trainer pkg/apis/trainer/v1alpha1/trainjob_types.go: TrainJob CEL rules on metadata.name
def _trainjob_name(trainjob: dict) -> list[str]:
    name = (trainjob.get("metadata") or {}).get("name", "")
    return (["metadata.name must match RFC 1035 DNS label format"] if not DNS1035_LABEL.fullmatch(name) else []) + \
        (["metadata.name must be no more than 63 characters"] if len(name) > 63 else [])


# kubeflow/trainer pkg/apis/trainer/v1alpha1/trainjob_types.go: Trainer.numProcPerNode CEL rule
def _num_proc_per_node(trainjob: dict) -> list[str]:
    num_proc = ((trainjob.get("spec") or {}).get("trainer") or {}).get("numProcPerNode")
    return ["numProcPerNode must be greater than or equal to 1"] if num_proc is not None and num_proc < 1 else []


# kubeflow/trainer pkg/apis/trainer/v1alpha1/trainjob_types.go: TrainJobSpec.managedBy CEL rule
def _trainjob_managed_by(trainjob: dict) -> list[str]:
    spec = trainjob.get("spec") or {}
    if "managedBy" in spec and spec["managedBy"] not in ("trainer.kubeflow.org/trainjob-controller",
                                                          "kueue.x-k8s.io/multikueue"):
        return ["ManagedBy must be trainer.kubeflow.org/trainjob-controller or kueue.x-k8s.io/multikueue if set"]
    return []


def runtime_ref(trainjob: dict) -> tuple[str, str, str]:
    """The TrainJob's runtimeRef with the CRD's defaults (apiGroup trainer.kubeflow.org, kind ClusterTrainingRuntime).

    Args:
        trainjob: a TrainJob.

    Returns:
        (apiGroup, kind, name).
    """
    ref = (trainjob.get("spec") or {}).get("runtimeRef") or {}
    return ref.get("apiGroup", TRAINER_GROUP), ref.get("kind", "ClusterTrainingRuntime"), ref.get("name", "")


# kubeflow/trainer pkg/webhooks/trainjob_webhook.go: ValidateCreate (runtime.RuntimeRefToRuntimeRegistryKey)
def _runtime_kind(trainjob: dict) -> list[str]:
    group, kind, _ = runtime_ref(trainjob)
    if group == TRAINER_GROUP and kind in RUNTIME_KINDS:
        return []
    return [f"unsupported runtime: {kind}.{group}" if group else f"unsupported runtime: {kind}"]


# kubeflow/trainer pkg/runtime/framework/plugins/jobset/jobset.go: Validate (runtimePatches[].manager)
def _patch_managers(trainjob: dict) -> list[str]:
    return [f"spec.runtimePatches.manager: {e}" for patch in (trainjob.get("spec") or {}).get("runtimePatches") or []
            for e in domain_prefixed_path(patch.get("manager", ""))]


TRAINJOB_RULES = (_trainjob_name, _num_proc_per_node, _trainjob_managed_by, _runtime_kind, _patch_managers)


def _patched_rjobs(trainjob: dict) -> list[dict]:
    return [rjob for patch in (trainjob.get("spec") or {}).get("runtimePatches") or []
            for rjob in ((((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {})
                         .get("replicatedJobs") or [])]


def merged_names(trainjob: dict, runtime: dict) -> dict[str, dict[str, dict[str, set[str]]]]:
    """The runtime's jobs, their containers and those containers' volumeMounts, merged by name with the TrainJob's
    runtimePatches, as the strategic merge of core/trainingruntime.go (mergeRuntimePatches) merges those lists; the
    plugins' Validate reads this merged template (ValidateObjects -> newRuntimeInfo).

    Args:
        trainjob: a TrainJob.
        runtime: the runtime it names.

    Returns:
        job -> "containers" or "initContainers" -> container -> its volumeMount names.
    """
    merged = {}
    for rjob in _runtime_rjobs(runtime) + _patched_rjobs(trainjob):
        pod = pod_spec(((rjob.get("template") or {}).get("spec") or {}).get("template"))
        job = merged.setdefault(rjob.get("name"), {"containers": {}, "initContainers": {}})
        for key in job:
            for container in pod.get(key) or []:
                job[key].setdefault(container.get("name"), set()).update(
                    m.get("name") for m in container.get("volumeMounts") or [])
    return merged


# kubeflow/trainer pkg/runtime/framework/plugins/jobset/jobset.go: Validate (patched jobs and containers exist).
# Upstream compares with the template already merged with these patches (merged_names), where a patched name always
# exists; its unit tests (jobset_test.go) compare with the runtime alone, as here, stricter than the webhook: a patch
# naming a job or container the runtime lacks adds a partial one (no image), which Kubernetes then refuses.
def _patch_targets(trainjob: dict, runtime: dict) -> list[str]:
    containers = {rjob.get("name"): {c.get("name") for c in _containers(rjob)} for rjob in _runtime_rjobs(runtime)}
    errors = []
    for patch in _patched_rjobs(trainjob):
        name = patch.get("name")
        if name not in containers:
            errors.append("spec.runtimePatches: must not have replicated job that doesn't exist in the runtime job "
                          "template")
            continue
        pod = pod_spec(((patch.get("template") or {}).get("spec") or {}).get("template"))
        for kind, key in (("initContainer", "initContainers"), ("container", "containers")):
            errors += [f"spec.runtimePatches: must not have {kind} that doesn't exist in the runtime job {name}"
                       for c in pod.get(key) or [] if c.get("name") not in containers[name]]
    return errors


# kubeflow/trainer pkg/runtime/framework/plugins/jobset/jobset.go: Validate (no env patched into managed containers)
def _patch_envs(trainjob: dict, runtime: dict) -> list[str]:
    containers = {rjob.get("name"): {c.get("name") for c in _containers(rjob)} for rjob in _runtime_rjobs(runtime)}
    errors = []
    for patch in _patched_rjobs(trainjob):
        known = containers.get(patch.get("name"), set()) & {"dataset-initializer", "model-initializer", "node"}
        pod = pod_spec(((patch.get("template") or {}).get("spec") or {}).get("template"))
        errors += ["spec.runtimePatches: must not have envs for the dataset-initializer, model-initializer, node "
                   "containers" for c in pod.get("containers") or [] if c.get("name") in known and c.get("env")]
    return errors


# kubeflow/trainer pkg/runtime/framework/plugins/jobset/jobset.go: Validate (initializer jobs for spec.initializer)
def _initializer_jobs(trainjob: dict, runtime: dict) -> list[str]:
    initializer = (trainjob.get("spec") or {}).get("initializer") or {}
    merged, errors = merged_names(trainjob, runtime), []
    for field, job, config in (("dataset", "dataset-initializer", "datasetConfig"),
                               ("model", "model-initializer", "modelConfig")):
        if field not in initializer:
            continue
        if job not in merged:
            errors.append(f"spec.runtimeRef: must have {job} job when trainJob is configured with input {config}")
        elif job not in merged[job]["containers"] and job not in merged[job]["initContainers"]:
            errors.append(f"spec.runtimeRef: must have container with name - {job} in the {job} job")
        elif "initializer" not in merged[job]["containers"].get(job, ()):  # jobsetplgconsts.VolumeNameInitializer
            errors.append(f"spec.runtimeRef: must have volumeMount with name - initializer in container {job} of "
                          f"the {job} job")
    return errors


# kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go: Validate (reserved PET_* envs)
def _torch_reserved_envs(trainjob: dict, runtime: dict) -> list[str]:
    if "torch" not in ((runtime.get("spec") or {}).get("mlPolicy") or {}):
        return []
    reserved = [n for n in TORCH_RESERVED_ENVS if n in env_names((trainjob.get("spec") or {}).get("trainer") or {})]
    return [f"spec.trainer.env: must not have reserved envs, invalid envs configured: [{' '.join(reserved)}]"
            ] if reserved else []


# kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go: validateEnvInjectionTargets
def _torch_env_injection_targets(trainjob: dict, runtime: dict) -> list[str]:
    torch = ((runtime.get("spec") or {}).get("mlPolicy") or {}).get("torch")
    if torch is None:
        return []
    merged = merged_names(trainjob, runtime)  # info.FindContainerByPodSetName: containers, then initContainers
    return [f'spec.runtimeRef: envInjection target podSet "{target.get("jobName")}" container "{name}" not found in '
            "runtime template" for target in (torch.get("envInjection") or {}).get("targets") or []
            for name in target.get("containerNames") or []
            if not any(name in found for found in merged.get(target.get("jobName"), {}).values())]


TRAINJOB_RUNTIME_RULES = (_patch_targets, _patch_envs, _initializer_jobs, _torch_reserved_envs,
                          _torch_env_injection_targets)


def trainjob_jobset(trainjob: dict, runtime: dict) -> dict:
    """The JobSet a TrainJob becomes (pkg/runtime/framework/plugins/jobset): named as the TrainJob, the runtime's
    template, ancestor jobs at one replica (builder.go: Initializer, Trainer), and each job's parallelism and
    completions set to its pod count (jobset.go: syncParallelCount), the trainer's being the TrainJob's numNodes, else
    the runtime's mlPolicy.numNodes (core/trainingruntime.go: newRuntimeInfo, torch.go: EnforceMLPolicy).

    Args:
        trainjob: a TrainJob.
        runtime: the TrainingRuntime or ClusterTrainingRuntime it names.

    Returns:
        The JobSet, before JobSet's defaulting.
    """
    spec = copy.deepcopy((((runtime.get("spec") or {}).get("template") or {}).get("spec")) or {})
    ml_policy = (runtime.get("spec") or {}).get("mlPolicy")
    nodes = ((trainjob.get("spec") or {}).get("trainer") or {}).get("numNodes") or (ml_policy or {}).get("numNodes")
    for rjob in spec.get("replicatedJobs") or []:
        job_spec = rjob.setdefault("template", {}).setdefault("spec", {})
        if _ancestor(rjob) in ANCESTOR_CONTAINERS:
            rjob["replicas"] = 1
        trainer = _ancestor(rjob) == "trainer" and ml_policy is not None
        job_spec["parallelism"] = job_spec["completions"] = (nodes or 1) if trainer else job_spec.get("parallelism", 1)
    metadata = trainjob.get("metadata") or {}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "spec": spec,
            "metadata": {"name": metadata.get("name", ""), "namespace": metadata.get("namespace")}}


def trainjob(doc: dict, runtime: dict | None = None) -> list[str]:
    """What Trainer's TrainJob webhook (pkg/webhooks/trainjob_webhook.go and the runtime plugins' Validate it runs)
    and CRD rules refuse; given the runtime it names, also what JobSet's webhook refuses in the JobSet it becomes,
    prefixed "its JobSet" (the TrainJob is admitted, but its JobSet never is: the run never starts).

    Args:
        doc: a `trainer.kubeflow.org/v1alpha1` TrainJob.
        runtime: the TrainingRuntime or ClusterTrainingRuntime its runtimeRef names; None skips the rules that
            need it (upstream reads it from the cluster).

    Returns:
        The refusals.
    """
    errors = [message for rule in TRAINJOB_RULES for message in rule(doc)]
    if runtime is None:
        return errors
    errors += [message for rule in TRAINJOB_RUNTIME_RULES for message in rule(doc, runtime)]
    return errors + [f"its JobSet: {message}" for message in jobset(trainjob_jobset(doc, runtime))]
