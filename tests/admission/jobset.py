"""JobSet's admission rules (kubernetes-sigs/jobset at 08dfbdfd682714a9ab929633eca8dc95315187e7): the validating
webhook pkg/webhooks/jobset_webhook.go (ValidateCreate and the validate* functions it calls), after the defaulting
webhook's defaults, and the CRD rules of api/jobset/v1alpha2/jobset_types.go. Trainer's rules (trainer.py) run these on
the JobSet a TrainJob becomes.
"""

import copy
import re

from tests.admission.k8s import (
    MAX_INT32,
    MAX_LEN_63,
    dns1035_label,
    dns1123_subdomain,
    domain_prefixed_path,
    label_value,
    pod_spec,
)

RULE_NAME = re.compile(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?")  # ruleNameFmt
JOB_FAILURE_REASONS = ("BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                       "PodFailurePolicy")  # validOnJobFailureReasons


def jobset_defaults(spec: dict) -> dict:
    """A JobSet spec as admission sees it: the CRD's defaults (replicas 1, groupName "default"), then the defaulting
    webhook's (jobset_webhook.go: Default: Indexed completion, successPolicy All, failurePolicyRule<N> names), the
    ones a validating rule reads.

    Args:
        spec: the JobSet's `spec` (or a TrainingRuntime's `spec.template.spec`), left unchanged.

    Returns:
        A defaulted copy.
    """
    spec = copy.deepcopy(spec)
    spec.setdefault("successPolicy", {"operator": "All"})
    for rjob in spec.get("replicatedJobs") or []:
        rjob.setdefault("replicas", 1)
        rjob.setdefault("groupName", "default")
        rjob.setdefault("template", {}).setdefault("spec", {}).setdefault("completionMode", "Indexed")
    for index, rule in enumerate((spec.get("failurePolicy") or {}).get("rules") or []):
        rule["name"] = rule.get("name") or f"failurePolicyRule{index}"
    return spec


def _rjobs(spec: dict) -> list[dict]:
    return spec.get("replicatedJobs") or []


def _rules(spec: dict) -> list[dict]:
    return (spec.get("failurePolicy") or {}).get("rules") or []


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: ValidateCreate (InPlaceRestart gate, off by default)
def _in_place_restart_gate(spec: dict) -> list[str]:
    if (spec.get("failurePolicy") or {}).get("restartStrategy") == "InPlaceRestart":
        return ["InPlaceRestart restart strategy cannot be set when InPlaceRestart feature gate is disabled"]
    return []


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: ValidateCreate (dependsOn of the first replicatedJob)
def _first_depends_on(spec: dict) -> list[str]:
    rjobs = _rjobs(spec)
    return ["DependsOn can't be set for the first ReplicatedJob"] if rjobs and "dependsOn" in rjobs[0] else []


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: ValidateCreate (network.subdomain: a Service's name too)
def _subdomain(spec: dict) -> list[str]:
    subdomain = (spec.get("network") or {}).get("subdomain") or ""
    if not subdomain:
        return []
    as_label = [".spec.network.subdomain is too long, must be less than 63 characters" if e == MAX_LEN_63 else e
                for e in dns1035_label(subdomain)]
    return [f"spec.network.subdomain: {e}" for e in dns1123_subdomain(subdomain) + as_label]


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: ValidateCreate (managedBy, maxManagedByLength)
def _managed_by(spec: dict) -> list[str]:
    if "managedBy" not in spec:
        return []
    manager = spec["managedBy"]
    too_long = ["may not be more than 63 bytes"] if len(manager) > 63 else []
    return [f"spec.managedBy: {e}" for e in domain_prefixed_path(manager) + too_long]


# kubernetes-sigs/jobset api/jobset/v1alpha2/jobset_types.go: replicatedJobs is +listType=map keyed by name
def _replicated_job_names_unique(spec: dict) -> list[str]:
    names = [rjob.get("name") for rjob in _rjobs(spec)]
    return [f'spec.replicatedJobs[{i}]: Duplicate value: {{"name":"{name}"}}'
            for i, name in enumerate(names) if name in names[:i]]


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: ValidateCreate (replicas x parallelism fits an int32)
def _replicas_times_parallelism(spec: dict) -> list[str]:
    return [f"the product of replicas and parallelism must not exceed {MAX_INT32} for replicatedJob '{rjob['name']}'"
            for rjob in _rjobs(spec)
            if rjob["replicas"] * rjob["template"]["spec"].get("parallelism", 1) > MAX_INT32]


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: ValidateCreate (groupName, a DNS-1035 label)
def _group_names(spec: dict) -> list[str]:
    too_long = ".spec.replicatedJob[].groupName is too long, must be less than 63 characters"
    return [f"spec.replicatedJobs[{i}].groupName: {too_long if e == MAX_LEN_63 else e}"
            for i, rjob in enumerate(_rjobs(spec)) for e in dns1035_label(rjob["groupName"])]


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: ValidateCreate (DependsOn references an earlier replicatedJob)
def _depends_on_earlier(spec: dict) -> list[str]:
    errors, seen = [], set()
    for rjob in _rjobs(spec):
        seen.add(rjob.get("name"))
        errors += [f"replicatedJob: {rjob.get('name')} cannot depend on replicatedJob: {dep.get('name')}"
                   for dep in rjob.get("dependsOn") or [] if dep.get("name") not in seen]
    return errors


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: ValidateCreate (successPolicy.targetReplicatedJobs)
def _success_targets(spec: dict) -> list[str]:
    names = {rjob.get("name") for rjob in _rjobs(spec)}
    return [f"invalid replicatedJob name '{name}' does not appear in .spec.ReplicatedJobs"
            for name in spec["successPolicy"].get("targetReplicatedJobs") or [] if name not in names]


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: validateFailurePolicy (RestartJob gate, off by default)
def _restart_job_gate(spec: dict) -> list[str]:
    if any(rule.get("action") in ("RestartJob", "RestartJobAndIgnoreMaxRestarts") for rule in _rules(spec)):
        return ["RestartJob and RestartJobAndIgnoreMaxRestarts failure policy actions are not allowed when RestartJob "
                "feature gate is disabled"]
    return []


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: validateFailurePolicy (rule names: length, ruleNameFmt, unique)
def _failure_rule_names(spec: dict) -> list[str]:
    errors, by_name = [], {}
    for index, rule in enumerate(_rules(spec)):
        name = rule["name"]
        by_name.setdefault(name, []).append(index)
        if not 1 <= len(name) <= 128:
            errors.append(f"invalid failure policy rule name of length {len(name)}, the rule name must be at least 1 "
                          "characters long and at most 128 characters long")
        if not RULE_NAME.fullmatch(name):
            errors.append(f"invalid failure policy rule name '{name}', a failure policy rule name must start with an "
                          "alphabetic character, optionally followed by a string of alphanumeric characters or "
                          "'_,:', and must end with an alphanumeric character or '_'")
    return errors + [f"rule names are not unique, rules with indices [{' '.join(map(str, indices))}] all have the "
                     f"same name '{name}'" for name, indices in by_name.items() if len(indices) > 1]


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: validateFailurePolicy (targetReplicatedJobs exist)
def _failure_rule_targets(spec: dict) -> list[str]:
    names = {rjob.get("name") for rjob in _rjobs(spec)}
    return [f"invalid replicatedJob name '{name}' in failure policy does not appear in .spec.ReplicatedJobs"
            for rule in _rules(spec) for name in rule.get("targetReplicatedJobs") or [] if name not in names]


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: validateFailurePolicy (validOnJobFailureReasons)
def _failure_rule_reasons(spec: dict) -> list[str]:
    return [f"invalid job failure reason '{reason}' in failure policy is not a recognized job failure reason"
            for rule in _rules(spec) for reason in rule.get("onJobFailureReasons") or []
            if reason not in JOB_FAILURE_REASONS]


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: validateCoordinator (the first error only, as upstream)
def _coordinator(spec: dict) -> list[str]:
    if "coordinator" not in spec:
        return []
    coordinator = spec["coordinator"]
    target, job_index, pod_index = coordinator.get("replicatedJob"), coordinator.get("jobIndex", 0), \
        coordinator.get("podIndex", 0)
    rjob = next((r for r in _rjobs(spec) if r.get("name") == target), None)
    if rjob is None:
        return [f"coordinator replicatedJob {target} does not exist"]
    if not 0 <= job_index < rjob["replicas"]:
        return [f"coordinator job index {job_index} is invalid for replicatedJob {target}"]
    job_spec = rjob["template"]["spec"]
    if job_spec.get("completionMode") != "Indexed" or job_spec.get("completions") is None:
        return ["job for coordinator pod must be indexed completion mode, and completions number must be set"]
    if not 0 <= pod_index < job_spec["completions"]:
        return [f"coordinator pod index {pod_index} is invalid for replicatedJob {target} job index {job_index}"]
    return []


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: validateVolumeClaimPolicies (what needs no cluster state)
def _volume_claim_policies(spec: dict) -> list[str]:
    errors, seen = [], set()
    for policy in spec.get("volumeClaimPolicies") or []:
        for template in policy.get("templates") or []:
            name = (template.get("metadata") or {}).get("name", "")
            if name in seen:
                errors.append(f"{name}: names must be unique for VolumeClaimPolicies template")
            errors += [f"{name}: {e}" for e in dns1123_subdomain(name)]
            errors += _volume_claim_mounts(spec, name)
            seen.add(name)
    return errors


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: validateReplicatedJobsVolumeClaims
def _volume_claim_mounts(spec: dict, claim: str) -> list[str]:
    errors, mounted = [], False
    for rjob in _rjobs(spec):
        pod = pod_spec(rjob["template"]["spec"].get("template"))
        errors += [f"volume name conflicts with VolumeClaimPolicy template name: {claim}"
                   for volume in pod.get("volumes") or [] if volume.get("name") == claim]
        containers = (pod.get("initContainers") or []) + (pod.get("containers") or [])
        mounted = mounted or any(m.get("name") == claim for c in containers for m in c.get("volumeMounts") or [])
    return errors + ([] if mounted else [
        f"replicatedJob containers don't have a matching volumeMount: {claim} from VolumeClaimPolicies"])


# kubernetes-sigs/jobset api/jobset/v1alpha2/jobset_types.go: JobSetSpec CEL rule (x-kubernetes-validations)
def _startup_policy_excludes_depends_on(spec: dict) -> list[str]:
    in_order = (spec.get("startupPolicy") or {}).get("startupPolicyOrder") == "InOrder"
    if in_order and any("dependsOn" in rjob for rjob in _rjobs(spec)):
        return ["StartupPolicy and DependsOn APIs are mutually exclusive"]
    return []


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: ValidateCreate (generated Job names, placement.GenJobName)
def _generated_job_names(spec: dict, name: str) -> list[str]:
    too_long = "JobSet name is too long, job names generated for this JobSet will exceed 63 characters"
    errors = []
    for i, rjob in enumerate(_rjobs(spec)):
        longest = f"{name}-{rjob['name']}-{rjob['replicas'] - 1}"
        errors += [f"spec.replicatedJobs[{i}].name: {too_long if e == MAX_LEN_63 else e}"
                   for e in dns1035_label(longest)]
    return errors


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: ValidateCreate (generated pod names, placement.GenPodName)
def _generated_pod_names(spec: dict, name: str) -> list[str]:
    too_long = "JobSet name is too long, pod names generated for this JobSet will exceed 63 characters"
    errors = []
    for i, rjob in enumerate(_rjobs(spec)):
        job_spec = rjob["template"]["spec"]
        if job_spec.get("completionMode") != "Indexed" or job_spec.get("completions") is None:
            continue  # upstream checks Indexed Jobs with completions only
        longest = f"{name}-{rjob['name']}-{rjob['replicas'] - 1}-{job_spec['completions'] - 1}-abcde"
        errors += [f"spec.replicatedJobs[{i}].name: {too_long if e == MAX_LEN_63 else e}"
                   for e in dns1035_label(longest)]
    return errors


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: validateCoordinatorLabelValue (controllers.CoordinatorEndpoint)
def _coordinator_label(spec: dict, name: str) -> list[str]:
    if "coordinator" not in spec:
        return []
    coordinator = spec["coordinator"]
    subdomain = (spec.get("network") or {}).get("subdomain") or name  # controllers.GetSubdomain
    value = (f"{name}-{coordinator.get('replicatedJob')}-{coordinator.get('jobIndex', 0)}-"
             f"{coordinator.get('podIndex', 0)}.{subdomain}")
    errors = label_value(value)
    if errors:
        return [f'spec will lead to invalid label value "{value}" for coordinator label '
                '"jobset.sigs.k8s.io/coordinator" (long JobSet / ReplicatedJob / SubDomain name?): '
                + ", ".join(errors)]
    return []


# kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go: validateVolumeClaimPolicies (controllers.GeneratePVCName)
def _volume_claim_name_lengths(spec: dict, name: str) -> list[str]:
    return [f"{claim}: VolumeClaimPolicies template name is too long"
            for policy in spec.get("volumeClaimPolicies") or [] for template in policy.get("templates") or []
            for claim in [(template.get("metadata") or {}).get("name", "")] if len(f"{claim}-{name}") > 63]


JOBSET_SPEC_RULES = (_in_place_restart_gate, _first_depends_on, _subdomain, _managed_by, _replicated_job_names_unique,
                     _replicas_times_parallelism, _group_names, _depends_on_earlier, _success_targets,
                     _restart_job_gate, _failure_rule_names, _failure_rule_targets, _failure_rule_reasons,
                     _coordinator, _volume_claim_policies, _startup_policy_excludes_depends_on)
JOBSET_NAMED_RULES = (_generated_job_names, _generated_pod_names, _coordinator_label, _volume_claim_name_lengths)


def jobset_spec(spec: dict, name: str | None) -> list[str]:
    """The JobSet webhook's refusals of a JobSet spec (defaults applied here).

    Args:
        spec: a JobSet's `spec`, or a TrainingRuntime's `spec.template.spec`.
        name: the JobSet's name; None (a runtime's template, named only by each TrainJob) skips the rules on the
            names generated from it.

    Returns:
        The webhook's messages, empty when it admits the spec.
    """
    spec = jobset_defaults(spec)
    named = [message for rule in JOBSET_NAMED_RULES for message in rule(spec, name)] if name is not None else []
    return [message for rule in JOBSET_SPEC_RULES for message in rule(spec)] + named


def _jobset_name(metadata: dict) -> str:
    # getJobSetNameForValidation: a generateName gets 5 random characters (names.SimpleNameGenerator, 58 kept)
    return metadata.get("name") or (metadata.get("generateName", "")[:58] + "abcde")


def jobset(doc: dict) -> list[str]:
    """What JobSet's webhook (pkg/webhooks/jobset_webhook.go) refuses in a JobSet being created.

    Args:
        doc: a `jobset.x-k8s.io/v1alpha2` JobSet.

    Returns:
        The refusals, in the webhook's words.
    """
    return jobset_spec(doc.get("spec") or {}, _jobset_name(doc.get("metadata") or {}))
