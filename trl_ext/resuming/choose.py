"""Which checkpoint a run resumes from: the one asked for, or with ``resume_from_checkpoint=True`` the newest committed
``checkpoint-N`` of the output directory, the same on every rank and present on every node; and, in a Slurm job that
was requeued, the newest committed checkpoint its earlier run left, without being asked (``after_requeue``). A
directory belongs to a Slurm job once it is marked with its id (``mark_for_job``): a fresh job never resumes another
job's directory by itself.

Only committed checkpoints are ever chosen: a checkpoint being written lives in a hidden staging directory
(``.checkpoint-N.trl_ext-partial``) until it is complete and checked, and ``get_last_checkpoint`` never matches it.
Every answer is decided on rank 0 and broadcast: ranks that look at the files on their own can disagree (NFS attribute
caching, node-local disks) and then take different collective paths, which hangs the job (KempnerForge#49).
"""

import os
from pathlib import Path

from transformers.trainer_utils import get_last_checkpoint

from trl_ext.errors import ResumeError
from trl_ext.process import slurm

JOB_MARKER = ".trl_ext-slurm-job"  # in an output directory: the id of the Slurm job that trains into it


def last_committed(output_dir: str | os.PathLike) -> str | None:
    """The newest committed ``checkpoint-N`` in ``output_dir`` (None if there is none, or no such directory).

    Args:
        output_dir: a run's output directory.

    Returns:
        The checkpoint's path, or None.
    """
    return get_last_checkpoint(str(output_dir)) if os.path.isdir(output_dir) else None


def checkpoint_to_resume(args, wanted) -> str | None:
    """The checkpoint every rank resumes from: ``wanted`` (a path, or True for the newest committed one), chosen on
    rank 0 and broadcast; refused if some rank cannot see it. Collective when ``args.world_size > 1``.

    Args:
        args: the run's ``TrainingArguments``.
        wanted: ``resume_from_checkpoint`` as given to ``train``: a path, or True.

    Returns:
        The same path on every rank (None: no checkpoint to resume; Trainer then says so for True).

    Raises:
        ResumeError: the checkpoint is missing where some rank runs.
    """
    from accelerate.utils import broadcast_object_list, gather_object

    path = last_committed(args.output_dir) if wanted is True else wanted
    if args.world_size <= 1:
        return path
    chosen = [path]
    broadcast_object_list(chosen, from_process=0)
    path = chosen[0]
    if path is None:
        return None
    missing = [rank for rank, seen in enumerate(gather_object([os.path.isdir(path)])) if not seen]
    if missing:
        raise ResumeError(f"checkpoint {path} (the one rank 0 resumes) is missing where rank {missing[0]} runs: give "
                          "every node a copy of it, or resume from a checkpoint all nodes have.")
    return path


def job_of(output_dir: str | os.PathLike) -> str | None:
    """The id of the Slurm job ``output_dir`` is marked for, or None."""
    try:
        return (Path(output_dir) / JOB_MARKER).read_text().strip() or None
    except OSError:
        return None


def mark_for_job(output_dir: str | os.PathLike) -> None:
    """In a Slurm job, mark ``output_dir`` as this job's (created if missing), so that a requeued run of the same job
    resumes from it; outside one, nothing. Once per job: an existing mark is left as it is.

    Args:
        output_dir: the run's output directory.
    """
    job = slurm.current()
    if job is None or job_of(output_dir) is not None:
        return
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(output_dir) / f"{JOB_MARKER}.{os.getpid()}"
    tmp.write_text(job.job_id)
    os.replace(tmp, Path(output_dir) / JOB_MARKER)


def after_requeue(output_dir: str | os.PathLike) -> tuple[str | None, str] | None:
    """In a Slurm job run again after a requeue (or restarted into its own directory): the newest committed checkpoint
    of ``output_dir`` if the directory is this job's, and the one line that says so; None otherwise (not under Slurm,
    another job's directory, or a first run).

    Args:
        output_dir: the run's output directory.

    Returns:
        ``(checkpoint or None, line)``: None when this job's earlier run committed no checkpoint yet.
    """
    job = slurm.current()
    if job is None or job_of(output_dir) != job.job_id:
        return None
    last = last_committed(output_dir)
    if last is None:
        return None, f"Slurm job {job.job_id}, restart {job.restart}: {output_dir} holds no committed checkpoint " \
                     "yet; training from the start"
    return last, f"Slurm job {job.job_id}, restart {job.restart}: resuming from {last}"


def requeued_checkpoint(args) -> str | None:
    """``after_requeue`` for a trainer, decided on rank 0 and broadcast (collective when ``args.world_size > 1``; call
    it on every rank, only under Slurm), said in one line; the output directory is marked for this job.

    Args:
        args: the run's ``TrainingArguments``.

    Returns:
        The checkpoint to resume, the same on every rank, or None.
    """
    from accelerate.utils import broadcast_object_list

    from trl_ext.process import notice

    answer = [None]
    if args.process_index == 0:
        requeued = after_requeue(args.output_dir)
        if requeued is not None and (requeued[0] is not None or slurm.current().restart > 0):
            notice(requeued[1])
        answer = [requeued[0] if requeued is not None else None]
        mark_for_job(args.output_dir)
    if args.world_size > 1:
        broadcast_object_list(answer, from_process=0)
    return answer[0]
