"""Which output directory belongs to which run, and what the run keeps there across its restarts.

A run is known by its orchestrator's identity (``orchestrators.Job.run``: a Slurm job id, a SkyPilot task id, a
TrainJob's name, torchrun's ``--rdzv-id``, ``TRL_EXT_RUN_ID``). A directory becomes a run's when the run first
claims it (``claim``): a hidden file, ``.trl_ext-run``, holds the run's identity and its record (its attempts, failures
in a row without a new checkpoint and the newest checkpoint seen when they were counted: ``failure_limit``; how long a
checkpoint and a step took). The same run, restarted (a requeued Slurm job, torchrun's restart, recreated pods, a
recovered SkyPilot task), trains on into its own directory and resumes from it (``is_own``); a fresh run never resumes
another run's directory by itself.
Under the node launcher each claim also tells it, on the first machine, where the run trains (in the machine's
``run_dir``): under Slurm the batch script reads the record there to decide whether to requeue the job
(``restart``).

Nothing here imports torch or transformers: the batch script reads it between runs.
"""

import json
import os
from pathlib import Path

from trl_ext.files import checkpoint_dirs as checkpoints
from trl_ext.placement import orchestrators

RUN_MARKER = ".trl_ext-run"  # in an output directory: the run that trains into it, and its record
RUN_ENV = "TRL_EXT_RUN_DIR"  # for the ranks: their machine's run directory (``run_dir``), set by the node launcher
OUTPUT_DIR_NOTE = "output_dir"  # in the first node's run directory: where this run trains
claimed_here: set[str] = set()  # the output directories this process marked for its run (its first attempt there)


def record(output_dir: str | os.PathLike) -> dict:
    """The run's record in ``output_dir``: ``{"run": identity, ...}``, or ``{}`` when the directory is no run's.

    Args:
        output_dir: a run's output directory.

    Returns:
        The record (``run``; once written: ``failures``, ``checkpoint``, ``save_seconds``, ``step_seconds``).
    """
    try:
        text = (Path(output_dir) / RUN_MARKER).read_text().strip()
    except OSError:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) and data.get("run") else {}


def run_of(output_dir: str | os.PathLike) -> str | None:
    """The identity of the run ``output_dir`` is marked for, or None."""
    return record(output_dir).get("run")


def current_run() -> str | None:
    """The identity of the run this process belongs to, or None (no orchestrator, or one that names no run)."""
    try:
        job = orchestrators.current()
    except SystemExit:  # contradictory variables: said where the launch is decided
        return None
    return job.run if job is not None else None


def is_own(output_dir: str | os.PathLike) -> bool:
    """Whether ``output_dir`` belongs to the run this process belongs to (False for a run without an identity)."""
    run = current_run()
    return run is not None and run_of(output_dir) == run


def claim(output_dir: str | os.PathLike, run: str | None = None) -> None:
    """For a run with an identity, make ``output_dir`` the run's (created if missing; an existing mark is left as it
    is, once per run) and tell the node launcher where this run trains; otherwise nothing.

    Args:
        output_dir: the run's output directory.
        run: the run's identity, where no orchestrator's variables give it (``trl_ext.ray.fit`` in a notebook).
    """
    job = orchestrators.current()
    run = run or (job.run if job is not None else None)
    if run is None:
        return
    if run_of(output_dir) is None:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        _write(output_dir, {"run": run, "attempts": 1})
        claimed_here.add(os.path.abspath(output_dir))
    if job is None:
        return
    run = os.environ.get(RUN_ENV)
    if run and job.node_rank == 0 and os.path.isdir(run):
        _replace(Path(run) / OUTPUT_DIR_NOTE, os.path.abspath(output_dir))


def update(output_dir: str | os.PathLike, **fields) -> None:
    """Add ``fields`` to the run's record in ``output_dir`` (only when the directory is this run's).

    Args:
        output_dir: the run's output directory.
        **fields: what to record (JSON values).
    """
    current = record(output_dir)
    run = current_run()
    if current and (run is None or current["run"] == run):
        _write(output_dir, {**current, **fields})


def replace_record(output_dir: str | os.PathLike, data: dict) -> None:
    """Write ``data`` whole as the record in ``output_dir`` (a copy of the run's record kept elsewhere, restored).

    Args:
        output_dir: the run's output directory (it exists).
        data: the record (``run`` and what was recorded).
    """
    _write(output_dir, data)
    claimed_here.discard(os.path.abspath(output_dir))  # an earlier attempt's record now


def newest_checkpoint(output_dir: str | os.PathLike) -> int:
    """The step of the newest committed ``checkpoint-N`` in ``output_dir`` (0 when there is none): what
    ``transformers.trainer_utils.get_last_checkpoint`` finds, without importing transformers (the batch script calls
    this between runs)."""
    return checkpoints.newest_step(output_dir)


def run_dir(job: orchestrators.Job) -> str:
    """This run's directory on this machine, where the ranks leave how they ended and, on the first machine, where the
    run trains: in the machine's temporary directory, named by the run, its restart and the machine (two Slurm nodes,
    or two pods' containers, may share a host).

    Args:
        job: the job, as this process sees it.

    Returns:
        The directory's path (not created here).
    """
    machine = job.host or str(job.node_rank)
    run = job.run or f"pid{os.getpid()}"
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), f"trl_ext-{run}.{job.restart}.{machine}")


def announced_output_dir(run_dir: str | os.PathLike) -> str | None:
    """Where the run whose first node's run directory is ``run_dir`` trains (None: it never got that far)."""
    try:
        return (Path(run_dir) / OUTPUT_DIR_NOTE).read_text().strip() or None
    except OSError:
        return None


def _write(output_dir, data: dict) -> None:
    _replace(Path(output_dir) / RUN_MARKER, json.dumps(data, sort_keys=True))


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}")  # one writer per process; the rename is atomic
    tmp.write_text(text)
    os.replace(tmp, path)
