"""KubeRay's admission rules (ray-project/kuberay at feeaf72facab4881ba2b179248bb67315634e229): for a RayJob, the
controller's validation ray-operator/controllers/ray/utils/validation.go (ValidateRayJobMetadata, ValidateRayJobSpec,
ValidateRayClusterSpec, which fail the RayJob at once) and the RayCluster webhook
ray-operator/pkg/webhooks/v1/raycluster_webhook.go that the RayCluster it creates passes too.
"""

import re

import yaml

from tests.admission.k8s import dns1035_label, env_names, label_value, pod_spec, qualified_name

MAX_RAYJOB_NAME = 53 - 6  # ray-operator/controllers/ray/utils/constant.go: MaxRayJobNameLength
SPEC_INVALID = "The RayJob spec is invalid: "
AUTOSCALER_V2 = "RAY_enable_autoscaler_v2"


def _ray_version(value: str) -> tuple[int, ...] | None:
    # k8s.io/apimachinery pkg/util/version.ParseGeneric: at least major.minor
    match = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.(\d+))?.*", value)
    return tuple(int(part or 0) for part in match.groups()) if match else None


def _head_container(cluster: dict) -> dict:
    containers = pod_spec((cluster.get("headGroupSpec") or {}).get("template")).get("containers") or [{}]
    return containers[0]  # RayContainerIndex


def _workers(cluster: dict) -> list[dict]:
    return cluster.get("workerGroupSpecs") or []


def _autoscaling(cluster: dict) -> bool:
    return bool(cluster.get("enableInTreeAutoscaling"))  # utils.IsAutoscalingEnabled


def _autoscaler_v2(cluster: dict) -> bool:
    # utils.IsAutoscalingV2Enabled, or the head's RAY_enable_autoscaler_v2 (KubeRay < 1.4)
    env = {e.get("name"): e.get("value") for e in _head_container(cluster).get("env") or []}
    return (cluster.get("autoscalerOptions") or {}).get("version") == "v2" or env.get(AUTOSCALER_V2) in ("1", "true")


# ray-project/kuberay ray-operator/controllers/ray/utils/validation.go: ValidateRayJobMetadata
def _rayjob_name(rayjob: dict) -> list[str]:
    name = (rayjob.get("metadata") or {}).get("name", "")
    if len(name) > MAX_RAYJOB_NAME:
        return [f"The RayJob metadata is invalid: RayJob name should be no more than {MAX_RAYJOB_NAME} characters"]
    errors = dns1035_label(name)
    return [f"The RayJob metadata is invalid: RayJob name should be a valid DNS1035 label: {errors}"] if errors else []


# ray-project/kuberay ray-operator/controllers/ray/utils/validation.go: ValidateRayJobSpec (suspend, TTL, backoffLimit,
# deadlines, the cluster source) and validateDeletionConfiguration
def _rayjob_lifecycle(spec: dict) -> list[str]:
    shutdown, selector = spec.get("shutdownAfterJobFinishes", False), spec.get("clusterSelector") or {}
    checks = [
        (spec.get("suspend") and not shutdown,
         "a RayJob with shutdownAfterJobFinishes set to false is not allowed to be suspended"),
        (spec.get("ttlSecondsAfterFinished", 0) < 0, "TTLSecondsAfterFinished must be a non-negative integer"),
        (not shutdown and spec.get("ttlSecondsAfterFinished", 0) > 0,
         "a RayJob with shutdownAfterJobFinishes set to false cannot have TTLSecondsAfterFinished"),
        (spec.get("suspend") and selector, "the ClusterSelector mode doesn't support the suspend operation"),
        ("rayClusterSpec" not in spec and not selector, "one of RayClusterSpec or ClusterSelector must be set"),
        (spec.get("activeDeadlineSeconds", 1) <= 0, "activeDeadlineSeconds must be a positive integer"),
        (spec.get("preRunningDeadlineSeconds", 1) <= 0, "preRunningDeadlineSeconds must be a positive integer"),
        (spec.get("backoffLimit", 0) < 0, "backoffLimit must be a positive integer"),
    ]
    return [SPEC_INVALID + message for failed, message in checks if failed]


# ray-project/kuberay ray-operator/controllers/ray/utils/validation.go: validateDeletionConfiguration (deletionStrategy)
def _rayjob_deletion_strategy(spec: dict) -> list[str]:
    strategy = spec.get("deletionStrategy")
    if strategy is None:
        return []
    legacy, rules = "onSuccess" in strategy or "onFailure" in strategy, bool(strategy.get("deletionRules"))
    if rules and spec.get("shutdownAfterJobFinishes"):
        return [SPEC_INVALID + "spec.shutdownAfterJobFinishes and spec.deletionStrategy.deletionRules are mutually "
                "exclusive"]
    if rules and legacy:
        return [SPEC_INVALID + "Cannot use both legacy onSuccess/onFailure fields and deletionRules simultaneously"]
    if not rules and not legacy:
        return [SPEC_INVALID + "DeletionStrategy requires either BOTH onSuccess and onFailure, OR the deletionRules "
                "field (cannot be empty)"]
    return []


# ray-project/kuberay ray-operator/controllers/ray/utils/validation.go: ValidateRayJobSpec (clusterSelector mode)
def _rayjob_cluster_selector(spec: dict) -> list[str]:
    selector = spec.get("clusterSelector") or {}
    if not selector:
        return []
    if not selector.get("ray.io/cluster"):  # RayJobClusterSelectorKey
        return ["cluster name in ClusterSelector should not be empty"]
    if spec.get("submissionMode") == "SidecarMode":
        return ["ClusterSelector is not supported in SidecarMode"]
    return [SPEC_INVALID + "BackoffLimit is incompatible with ClusterSelector mode"] if spec.get(
        "backoffLimit", 0) > 0 else []


# ray-project/kuberay ray-operator/controllers/ray/utils/validation.go: ValidateRayJobSpec (submissionMode)
def _rayjob_submission_mode(spec: dict) -> list[str]:
    mode = spec.get("submissionMode", "K8sJobMode")  # the CRD's default
    if mode == "InteractiveMode" and spec.get("backoffLimit", 0) > 0:
        return [SPEC_INVALID + "BackoffLimit is incompatible with InteractiveMode"]
    if mode != "SidecarMode":
        return []
    if "submitterPodTemplate" in spec:
        return ["Currently, SidecarMode doesn't support SubmitterPodTemplate"]
    if "submitterConfig" in spec:
        return ["Currently, SidecarMode doesn't support SubmitterConfig"]
    head = (spec.get("rayClusterSpec") or {}).get("headGroupSpec") or {}
    if pod_spec(head.get("template")).get("restartPolicy", "Never") != "Never":
        return ["restartPolicy for head Pod should be Never or unset when using SidecarMode"]
    return []


# ray-project/kuberay ray-operator/controllers/ray/utils/validation.go: ValidateRayJobSpec (RuntimeEnvYAML, a mapping)
def _rayjob_runtime_env(spec: dict) -> list[str]:
    text = spec.get("runtimeEnvYAML", "")
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError as error:
        return [f"failed to unmarshal RuntimeEnvYAML: {text}: {error}"]
    return [] if parsed is None or isinstance(parsed, dict) else [f"failed to unmarshal RuntimeEnvYAML: {text}"]


# ray-project/kuberay ray-operator/controllers/ray/utils/validation.go: ValidateRayJobSpec (IsK8sAuthEnabled)
def _rayjob_k8s_auth(spec: dict) -> list[str]:
    if ((spec.get("rayClusterSpec") or {}).get("authOptions") or {}).get("enableK8sTokenAuth"):
        return [SPEC_INVALID + "K8s token auth mode is currently not supported for RayJob"]
    return []


RAYJOB_SPEC_RULES = (_rayjob_lifecycle, _rayjob_deletion_strategy, _rayjob_cluster_selector, _rayjob_submission_mode,
                     _rayjob_runtime_env, _rayjob_k8s_auth)


# ray-project/kuberay ray-operator/controllers/ray/utils/validation.go: ValidateRayClusterSpec (containers)
def _cluster_containers(cluster: dict, annotations: dict) -> list[str]:
    if not pod_spec((cluster.get("headGroupSpec") or {}).get("template")).get("containers"):
        return ["headGroupSpec should have at least one container"]
    return ["workerGroupSpec should have at least one container" for group in _workers(cluster)
            if not pod_spec(group.get("template")).get("containers")][:1]


# ray-project/kuberay ray-operator/controllers/ray/utils/validation.go: validateRayGroupResources, ...Labels
def _group_resources_and_labels(cluster: dict, annotations: dict) -> list[str]:
    groups = [("Head", cluster.get("headGroupSpec") or {})] + [(g.get("groupName"), g) for g in _workers(cluster)]
    errors = []
    for name, group in groups:
        params = group.get("rayStartParams") or {}
        if any(params.get(key) for key in ("num-cpus", "num-gpus", "memory", "resources")) and group.get("resources"):
            errors.append(f"resource fields should not be set in both rayStartParams and Resources for {name} group; "
                          "please use only one")
        if "labels" in params:
            errors.append(f"rayStartParams['labels'] is not supported for {name} group; please use the top-level "
                          "Labels field instead")
        for key, value in (group.get("labels") or {}).items():
            errors += [f"invalid label key for {name} group: '{key}', error: {e}" for e in qualified_name(key)]
            errors += [f"invalid label value for key '{key}' in {name} group: '{value}', error: {e}"
                       for e in label_value(value)]
    return errors


# ray-project/kuberay ray-operator/controllers/ray/utils/validation.go: ValidateRayClusterSpec (min/maxReplicas)
def _worker_replicas(cluster: dict, annotations: dict) -> list[str]:
    errors = []
    for group in _workers(cluster):
        name, low, high = group.get("groupName"), group.get("minReplicas"), group.get("maxReplicas")
        if not _autoscaling(cluster) and (low is None or high is None):
            errors.append(f"worker group {name} must set both minReplicas and maxReplicas when autoscaling is disabled")
        elif low is not None and low < 0:
            errors.append(f"worker group {name} has negative minReplicas {low}")
        elif high is not None and high < 0:
            errors.append(f"worker group {name} has negative maxReplicas {high}")
        elif low is not None and high is not None and low > high:
            errors.append(f"worker group {name} has minReplicas {low} greater than maxReplicas {high}")
    return errors


# ray-project/kuberay ray-operator/controllers/ray/utils/validation.go: validateWorkerGroupIdleTimeout
def _worker_idle_timeout(cluster: dict, annotations: dict) -> list[str]:
    errors = []
    for group in _workers(cluster):
        timeout, name = group.get("idleTimeoutSeconds"), group.get("groupName")
        if timeout is not None and timeout < 0:
            errors.append(f"worker group {name}: idleTimeoutSeconds must be non-negative, got {timeout}")
        elif timeout is not None and not _autoscaler_v2(cluster):
            errors.append(f"worker group {name}: idleTimeoutSeconds is set, but autoscaler v2 is not enabled. Please "
                          f"set .spec.autoscalerOptions.version to 'v2' (or set {AUTOSCALER_V2} environment variable "
                          "to 'true' in the head pod if using KubeRay < 1.4.0)")
    return errors


# ray-project/kuberay ray-operator/controllers/ray/utils/validation.go: validateWorkerGroupPriority
def _worker_priority(cluster: dict, annotations: dict) -> list[str]:
    errors, version = [], _ray_version(cluster.get("rayVersion", ""))
    for group in _workers(cluster):
        priority, name = group.get("priority"), group.get("groupName")
        if not priority:
            continue
        if not cluster.get("rayVersion"):
            errors.append(f"worker group {name}: priority is set, but RayVersion was not specified. Ray version "
                          "2.56.0 or later is required")
        elif version is None or version < (2, 56, 0):
            errors.append(f"worker group {name}: priority is set, but minimum Ray version is 2.56.0, got "
                          f"{cluster['rayVersion']}")
        elif not _autoscaler_v2(cluster):
            errors.append(f"worker group {name}: priority is set to {priority}, but autoscaler v2 is not enabled. "
                          "Priority is only supported with autoscaler v2 enabled")
    return errors


# ray-project/kuberay ray-operator/controllers/ray/utils/validation.go: ValidateRayClusterSpec (GCS fault tolerance:
# the annotation and the options, RAY_REDIS_ADDRESS, a redis username)
def _gcs_fault_tolerance(cluster: dict, annotations: dict) -> list[str]:
    options, head = cluster.get("gcsFaultToleranceOptions"), _head_container(cluster)
    enabled = str(annotations.get("ray.io/ft-enabled", "")).lower() == "true" or options is not None
    if annotations.get("ray.io/ft-enabled") and options is not None:
        return ["ray.io/ft-enabled annotation and GcsFaultToleranceOptions are both set. Please use only "
                "GcsFaultToleranceOptions to configure GCS fault tolerance"]
    if not enabled and "RAY_REDIS_ADDRESS" in env_names(head):
        return ["RAY_REDIS_ADDRESS is set which implicitly enables GCS fault tolerance, but GcsFaultToleranceOptions "
                "is not set. Please set GcsFaultToleranceOptions to enable GCS fault tolerance"]
    params = (cluster.get("headGroupSpec") or {}).get("rayStartParams") or {}
    if params.get("redis-username") or "REDIS_USERNAME" in env_names(head):
        return ["cannot set redis username in rayStartParams or environment variables - use "
                "GcsFaultToleranceOptions.RedisUsername instead"]
    return []


# ray-project/kuberay ray-operator/controllers/ray/utils/validation.go: ValidateRayClusterSpec (autoscaler settings)
def _autoscaler(cluster: dict, annotations: dict) -> list[str]:
    env = {e.get("name"): e.get("value") for e in _head_container(cluster).get("env") or []}
    options = cluster.get("autoscalerOptions") or {}
    if not _autoscaling(cluster) and env.get(AUTOSCALER_V2) in ("1", "true"):
        return [f"environment variable {AUTOSCALER_V2} cannot be set to '{env[AUTOSCALER_V2]}' when "
                "enableInTreeAutoscaling is false. Please set enableInTreeAutoscaling: true to use autoscaler v2"]
    if _autoscaling(cluster):
        suspended = [g.get("groupName") for g in _workers(cluster) if g.get("suspend")]
        if suspended:
            return [f"worker group {suspended[0]} cannot be suspended with Autoscaler enabled"]
        if "version" in options and AUTOSCALER_V2 in env:
            return [f"both .spec.autoscalerOptions.version and head Pod env var {AUTOSCALER_V2} are set, please only "
                    "use the former"]
        if options.get("version") == "v2":
            pods = [("head Pod", (cluster.get("headGroupSpec") or {}).get("template"))] + \
                [(f"worker group {g.get('groupName')}", g.get("template")) for g in _workers(cluster)]
            for where, template in pods:
                if pod_spec(template).get("restartPolicy", "Never") != "Never":
                    return [f"restartPolicy for {where} should be Never or unset when using autoscaler V2"]
    if options.get("idleTimeoutSeconds", 0) < 0:
        return [f"autoscalerOptions.idleTimeoutSeconds must be non-negative, got {options['idleTimeoutSeconds']}"]
    if "KUBERAY_GEN_AUTOSCALER_START_CMD" in env_names(options):
        return ["autoscalerOptions.env must not contain KUBERAY_GEN_AUTOSCALER_START_CMD: it is managed by KubeRay and "
                "injected automatically into the autoscaler container"]
    return []


# ray-project/kuberay ray-operator/controllers/ray/utils/validation.go: ValidateRayClusterSpec (authOptions)
def _auth(cluster: dict, annotations: dict) -> list[str]:
    auth = cluster.get("authOptions") or {}
    if auth.get("mode") != "token":
        return ["authOptions.enableK8sTokenAuth is enabled but authOptions.mode not set to 'token'"
                ] if auth.get("enableK8sTokenAuth") else []
    version = cluster.get("rayVersion", "")
    if not version:
        return ["authOptions.mode is 'token' but RayVersion was not specified. Ray version 2.52.0 or later is required"]
    if _ray_version(version) is None or _ray_version(version) < (2, 52, 0):
        return [f"authOptions.mode is 'token' but minimum Ray version is 2.52.0, got {version}"]
    return []


# ray-project/kuberay ray-operator/controllers/ray/utils/validation.go: ValidateRayClusterSpec (alpha gates, off by
# default: suspended worker groups need RayJobDeletionPolicy, which is on; these three are off)
def _cluster_feature_gates(cluster: dict, annotations: dict) -> list[str]:
    gated = [("historyServerOptions", "RayClusterHistoryServer feature gate is not enabled"),
             ("networkPolicy", "spec.networkPolicy requires the RayClusterNetworkPolicy feature gate to be enabled"),
             ("tlsOptions", "spec.tlsOptions requires the RayClusterMTLS feature gate to be enabled")]
    return [message for key, message in gated if key in cluster]


# ray-project/kuberay ray-operator/pkg/webhooks/v1/raycluster_webhook.go: validateWorkerGroups (the RayCluster the
# RayJob creates passes this webhook too)
def _worker_group_names_unique(cluster: dict, annotations: dict) -> list[str]:
    names = [group.get("groupName") for group in _workers(cluster)]
    return [f"spec.workerGroupSpecs[{i}]: worker group names must be unique"
            for i, name in enumerate(names) if name in names[:i]][:1]


RAYCLUSTER_SPEC_RULES = (_cluster_containers, _group_resources_and_labels, _worker_replicas, _worker_idle_timeout,
                         _worker_priority, _gcs_fault_tolerance, _autoscaler, _auth, _cluster_feature_gates,
                         _worker_group_names_unique)


def raycluster_spec(cluster: dict, annotations: dict) -> list[str]:
    """What KubeRay refuses in a RayClusterSpec (validation.go: ValidateRayClusterSpec; upstream returns the first
    error only, this lists each rule's).

    Args:
        cluster: a RayJob's `spec.rayClusterSpec`.
        annotations: the RayJob's annotations (the GCS fault-tolerance annotation).

    Returns:
        The refusals.
    """
    return [message for rule in RAYCLUSTER_SPEC_RULES for message in rule(cluster, annotations)]


def rayjob(doc: dict) -> list[str]:
    """What KubeRay refuses in a RayJob: its webhook (pkg/webhooks/v1/rayjob_webhook.go, the metadata) and the
    controller's validation (ValidateRayJobSpec), which fails the RayJob at once.

    Args:
        doc: a `ray.io/v1` RayJob.

    Returns:
        The refusals, in KubeRay's words.
    """
    spec = doc.get("spec") or {}
    errors = _rayjob_name(doc) + [message for rule in RAYJOB_SPEC_RULES for message in rule(spec)]
    if "rayClusterSpec" in spec:
        annotations = (doc.get("metadata") or {}).get("annotations") or {}
        errors += [SPEC_INVALID + message for message in raycluster_spec(spec["rayClusterSpec"], annotations)]
    return errors
