"""A Ray job's variables, as Ray's job supervisor gives them to the job's driver."""

import json

from trl_ext.placement.orchestrators.job import Job, value


def read() -> Job | None:
    """The driver of a Ray job (``ray job submit -- python recipes/dpo.py ...``; KubeRay's RayJob submits the same way):
    Ray's job supervisor gives it the job's config, whose submission id names the run. One process for the cluster: it
    starts the ranks as a Ray Train worker group (``trl_ext.ray``)."""
    text = value("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if text is None:
        return None
    try:
        submission = (json.loads(text).get("metadata") or {}).get("job_submission_id")
    except (ValueError, AttributeError):
        submission = None
    return Job("Ray", per_rank=False, run=f"ray-{submission}" if submission else None,
               source="RAY_JOB_CONFIG_JSON_ENV_VAR")
