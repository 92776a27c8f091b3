"""LeaderWorkerSet's admission rules (kubernetes-sigs/lws at 060ab4da17eea1f0865fcbd3236bb1075e2cea32): the
validating webhook pkg/webhooks/leaderworkerset_webhook.go (generalValidate, validateUpdateSubGroupPolicy), after the
CRD's and the defaulting webhook's defaults.
"""

import copy

from tests.admission.k8s import MAX_INT32, PERCENT, dns1035_label, scaled_int_or_percent

SUBGROUP_EXCLUSIVE = "leaderworkerset.sigs.k8s.io/subgroup-exclusive-topology"  # SubGroupExclusiveKeyAnnotationKey
ROLLING = "spec.rolloutStrategy.rollingUpdateConfiguration"


def lws_defaults(spec: dict) -> dict:
    """A LeaderWorkerSet spec as admission sees it: the CRD's defaults (replicas 1, size 1; maxUnavailable 1, maxSurge
    0, partition 0 in a rollingUpdateConfiguration) and the defaulting webhook's (leaderworkerset_webhook.go: Default:
    RollingUpdate with that configuration), the ones the validating rules read.

    Args:
        spec: the LeaderWorkerSet's `spec`, left unchanged.

    Returns:
        A defaulted copy.
    """
    spec = copy.deepcopy(spec)
    spec.setdefault("replicas", 1)
    spec.setdefault("leaderWorkerTemplate", {}).setdefault("size", 1)
    rollout = spec.setdefault("rolloutStrategy", {})
    rollout.setdefault("type", "RollingUpdate")
    if rollout["type"] == "RollingUpdate":
        rollout.setdefault("rollingUpdateConfiguration", {})
    config = rollout.get("rollingUpdateConfiguration")
    if config is not None:
        config.setdefault("maxUnavailable", 1)
        config.setdefault("maxSurge", 0)
        config.setdefault("partition", 0)
    return spec


def _int_or_percent(value, path: str) -> list[str]:
    # leaderworkerset_webhook.go: ValidatePositiveIntOrPercent, then IsNotMoreThan100Percent
    if isinstance(value, int):
        return [f"{path}: must be greater than or equal to 0"] if value < 0 else []
    if not PERCENT.fullmatch(str(value)):
        return [f"{path}: a valid percent string must be a numeric string followed by an ending '%'"]
    return [f"{path}: must not be greater than 100%"] if int(value[:-1]) > 100 else []


# kubernetes-sigs/lws pkg/webhooks/leaderworkerset_webhook.go: generalValidate (NameIsDNS1035Label: a Service's name)
def _lws_name(doc: dict, spec: dict) -> list[str]:
    return [f"metadata.name: {e}" for e in dns1035_label((doc.get("metadata") or {}).get("name", ""))]


# kubernetes-sigs/lws pkg/webhooks/leaderworkerset_webhook.go: generalValidate (replicas)
def _lws_replicas(doc: dict, spec: dict) -> list[str]:
    replicas = spec["replicas"]
    return (["spec.replicas: replicas must be equal or greater than 0"] if replicas < 0 else []) + \
        (["spec.replicas: replicas must be equal or less than 1000000"] if replicas > 1000000 else [])


# kubernetes-sigs/lws pkg/webhooks/leaderworkerset_webhook.go: generalValidate (size)
def _lws_size(doc: dict, spec: dict) -> list[str]:
    if spec["leaderWorkerTemplate"]["size"] < 1:
        return ["spec.leaderWorkerTemplate.size: size must be equal or greater than 1"]
    return []


# kubernetes-sigs/lws pkg/webhooks/leaderworkerset_webhook.go: generalValidate (replicas x size fits an int32)
def _lws_pods(doc: dict, spec: dict) -> list[str]:
    if spec["replicas"] * spec["leaderWorkerTemplate"]["size"] > MAX_INT32:
        return [f"spec.replicas: the product of replicas and worker replicas must not exceed {MAX_INT32}"]
    return []


# kubernetes-sigs/lws pkg/webhooks/leaderworkerset_webhook.go: generalValidate (maxUnavailable, maxSurge, partition)
def _lws_rolling_update(doc: dict, spec: dict) -> list[str]:
    config = spec["rolloutStrategy"].get("rollingUpdateConfiguration")
    if config is None:
        return []
    errors = _int_or_percent(config["maxUnavailable"], f"{ROLLING}.maxUnavailable")
    errors += _int_or_percent(config["maxSurge"], f"{ROLLING}.maxSurge")
    if config["partition"] < 0:
        errors.append(f"{ROLLING}.partition: must be greater than or equal to 0")
    return errors


# kubernetes-sigs/lws pkg/webhooks/leaderworkerset_webhook.go: generalValidate (maxUnavailable and maxSurge not both 0)
def _lws_rollout_progresses(doc: dict, spec: dict) -> list[str]:
    config = spec["rolloutStrategy"].get("rollingUpdateConfiguration") or {"maxUnavailable": 0, "maxSurge": 0}
    unavailable = scaled_int_or_percent(config["maxUnavailable"], spec["replicas"], round_up=False)
    surge = scaled_int_or_percent(config["maxSurge"], spec["replicas"], round_up=True)
    errors = ([f"{ROLLING}.maxUnavailable: invalid value"] if unavailable is None else []) + \
        ([f"{ROLLING}.maxSurge: invalid value"] if surge is None else [])
    if not unavailable and not surge and spec["replicas"] != 0:
        errors.append(f"{ROLLING}.maxUnavailable: must not be 0 when `maxSurge` is 0")
    return errors


# kubernetes-sigs/lws pkg/webhooks/leaderworkerset_webhook.go: validateUpdateSubGroupPolicy (run on create too)
def _lws_subgroups(doc: dict, spec: dict) -> list[str]:
    template = spec["leaderWorkerTemplate"]
    policy = template.get("subGroupPolicy")
    if policy is None:
        return []
    size, sub = template["size"], policy.get("subGroupSize", 0)
    path = "spec.leaderWorkerTemplate.SubGroupPolicy.subGroupSize"
    if sub < 1:
        return [f"{path}: subGroupSize must be equal or greater than 1"]  # upstream would divide by zero next
    errors = [f"{path}: size or size - 1 must be divisible by subGroupSize"] if size % sub and (size - 1) % sub else []
    errors += [f"{path}: subGroupSize cannot be larger than size"] if size < sub else []
    if policy.get("type") == "LeaderExcluded" and (size - 1) % sub:
        errors.append(f"{path}: size-1 must be divisible by subGroupSize when using LeaderExcluded")
    return errors


# kubernetes-sigs/lws pkg/webhooks/leaderworkerset_webhook.go: generalValidate (subgroup-exclusive-topology annotation)
def _lws_subgroup_annotation(doc: dict, spec: dict) -> list[str]:
    annotations = (doc.get("metadata") or {}).get("annotations") or {}
    if "subGroupPolicy" not in spec["leaderWorkerTemplate"] and SUBGROUP_EXCLUSIVE in annotations:
        return [f"metadata.annotations.{SUBGROUP_EXCLUSIVE}: cannot have subgroup-exclusive-topology without "
                "subGroupSize set"]
    return []


LWS_RULES = (_lws_name, _lws_replicas, _lws_size, _lws_pods, _lws_rolling_update, _lws_rollout_progresses,
             _lws_subgroups, _lws_subgroup_annotation)


def leaderworkerset(doc: dict) -> list[str]:
    """What LeaderWorkerSet's webhook (pkg/webhooks/leaderworkerset_webhook.go: generalValidate) refuses.

    Args:
        doc: a `leaderworkerset.x-k8s.io/v1` LeaderWorkerSet.

    Returns:
        The refusals, in the webhook's words.
    """
    spec = lws_defaults(doc.get("spec") or {})
    return [message for rule in LWS_RULES for message in rule(doc, spec)]
