"""Which output directory belongs to which Slurm job, and what the job keeps there across its runs.

A directory becomes a job's when the job's first run claims it (``claim``): a hidden file, ``.trl_ext-slurm-job``,
holds the job's id and its record (failures in a row without a new checkpoint, the newest checkpoint seen at the last
failure, how long a checkpoint and a step took). A run of the same job, after a requeue, trains on into its own
directory and resumes from it (``is_own``); a fresh job never resumes another job's directory by itself. Each claim
also tells the batch script, on the first node, where the run trains (in the node's ``run_dir``): after the step
ends, it reads the record there to decide whether to requeue the job (``restart``).

Nothing here imports torch or transformers: the batch script reads it between runs.
"""

import json
import os
import re
from pathlib import Path

from trl_ext.scheduling import job as slurm

JOB_MARKER = ".trl_ext-slurm-job"  # in an output directory: the Slurm job that trains into it, and its record
RUN_ENV = "TRL_EXT_SLURM_RUN"  # for the ranks: their node's run directory (``run_dir``), set by the node's launcher
OUTPUT_DIR_NOTE = "output_dir"  # in the first node's run directory: where this run trains
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR; partial saves are hidden


def record(output_dir: str | os.PathLike) -> dict:
    """The job's record in ``output_dir``: ``{"job": id, ...}``, or ``{}`` when the directory is no job's.

    Args:
        output_dir: a run's output directory.

    Returns:
        The record (``job``; once written: ``failures``, ``checkpoint``, ``save_seconds``, ``step_seconds``).
    """
    try:
        text = (Path(output_dir) / JOB_MARKER).read_text().strip()
    except OSError:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) and data.get("job") else {}


def job_of(output_dir: str | os.PathLike) -> str | None:
    """The id of the Slurm job ``output_dir`` is marked for, or None."""
    return record(output_dir).get("job")


def is_own(output_dir: str | os.PathLike) -> bool:
    """Whether ``output_dir`` belongs to the Slurm job this process runs in (False outside Slurm)."""
    job = slurm.current()
    return job is not None and job_of(output_dir) == job.job_id


def claim(output_dir: str | os.PathLike) -> None:
    """In a Slurm job, make ``output_dir`` this job's (created if missing; an existing mark is left as it is, once per
    job) and tell the batch script where this run trains; outside one, nothing.

    Args:
        output_dir: the run's output directory.
    """
    job = slurm.current()
    if job is None:
        return
    if job_of(output_dir) is None:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        _write(output_dir, {"job": job.job_id})
    run = os.environ.get(RUN_ENV)
    if run and job.node_rank == 0 and os.path.isdir(run):
        _replace(Path(run) / OUTPUT_DIR_NOTE, os.path.abspath(output_dir))


def update(output_dir: str | os.PathLike, **fields) -> None:
    """Add ``fields`` to the job's record in ``output_dir`` (only when the directory is this job's).

    Args:
        output_dir: the run's output directory.
        **fields: what to record (JSON values).
    """
    current = record(output_dir)
    job = slurm.current()
    if current and (job is None or current["job"] == job.job_id):
        _write(output_dir, {**current, **fields})


def newest_checkpoint(output_dir: str | os.PathLike) -> int:
    """The step of the newest committed ``checkpoint-N`` in ``output_dir`` (0 when there is none): what
    ``transformers.trainer_utils.get_last_checkpoint`` finds, without importing transformers (the batch script calls
    this between runs)."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return 0
    steps = [int(m.group(1)) for name in names if (m := _CHECKPOINT.match(name))
             and os.path.isdir(os.path.join(output_dir, name))]
    return max(steps, default=0)


def run_dir(job: slurm.SlurmJob) -> str:
    """This run's directory on this node, where the ranks leave how they ended and, on the first node, where the run
    trains: in the node's temporary directory, named by the job, its restart and the node (two Slurm nodes may share a
    host).

    Args:
        job: the job, as this process sees it.

    Returns:
        The directory's path (not created here).
    """
    node = os.environ.get("SLURMD_NODENAME") or str(job.node_rank)
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), f"trl_ext-slurm-{job.job_id}.{job.restart}.{node}")


def announced_output_dir(run_dir: str | os.PathLike) -> str | None:
    """Where the run whose first node's run directory is ``run_dir`` trains (None: it never got that far)."""
    try:
        return (Path(run_dir) / OUTPUT_DIR_NOTE).read_text().strip() or None
    except OSError:
        return None


def _write(output_dir, data: dict) -> None:
    _replace(Path(output_dir) / JOB_MARKER, json.dumps(data, sort_keys=True))


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}")  # one writer per process; the rename is atomic
    tmp.write_text(text)
    os.replace(tmp, path)
