"""Which checkpoint a run resumes from: the one asked for, or with ``resume_from_checkpoint=True`` the newest committed
``checkpoint-N`` of the output directory, the same on every rank and present on every node; and, in a run that its
orchestrator restarted (a requeued Slurm job, torchrun's restart, recreated pods, a recovered SkyPilot task), the
newest committed checkpoint its earlier attempt left, without being asked (``after_restart``), in the run's own
directory only (``placement.ownership``): a fresh run never resumes another run's directory by itself.

With the memory tier (``memory_checkpoint_steps``), a restarted run and ``resume_from_checkpoint=True`` take its newest
whole memory checkpoint where it is newer than the disk's (``newer_in_memory``, ``newer_in_memory_asked``), said in
one line naming the step and the tier.

Only committed checkpoints are ever chosen: a checkpoint being written lives in a hidden partial directory
(``.checkpoint-N.trl_ext-partial``) until it is complete and checked, and ``get_last_checkpoint`` never matches it.
Every answer is decided on rank 0 and broadcast: ranks that look at the files on their own can disagree (NFS attribute
caching, node-local disks) and then take different collective paths, which hangs the job (KempnerForge#49).
"""

import os

from transformers.trainer_utils import get_last_checkpoint

from trl_ext.errors import ResumeError
from trl_ext.files import checkpoint_dirs
from trl_ext.placement import orchestrators, ownership
from trl_ext.settings.trainer_options import MirrorOptions


def last_committed(output_dir: str | os.PathLike) -> str | None:
    """The newest committed ``checkpoint-N`` in ``output_dir`` (None if there is none, or no such directory).

    Args:
        output_dir: a run's output directory.

    Returns:
        The checkpoint's path, or None.
    """
    return get_last_checkpoint(str(output_dir)) if os.path.isdir(output_dir) else None


def newer_in_memory(memory, disk: str | None) -> tuple[str | None, str | None]:
    """The memory tier's newest whole checkpoint where it is newer than ``disk`` (read where it is kept: call it on
    the process that decides).

    Args:
        memory: the run's ``saving.memory_tier.MemoryTier``, or None.
        disk: the disk checkpoint the run would resume otherwise, or None.

    Returns:
        ``(path or None, line or None)``: the line says what is resumed, or why a memory checkpoint is not.
    """
    if memory is None:
        return None, None
    path, skipped = memory.newest()
    disk_step = checkpoint_dirs.step_of(disk) or 0 if disk else 0
    if path is None or checkpoint_dirs.step_of(path) <= disk_step:
        return None, skipped
    newest_on_disk = f"the newest on disk is {checkpoint_dirs.name(disk_step)}" if disk else "none is on disk"
    return path, f"resuming from step {checkpoint_dirs.step_of(path)} in memory ({path}); {newest_on_disk}"


def newer_in_memory_asked(args, memory) -> str | None:
    """For ``resume_from_checkpoint=True``: the memory tier's newest whole checkpoint where it is newer than the output
    directory's, said in one line; decided on rank 0 and broadcast (collective when distributed).

    Args:
        args: the run's ``TrainingArguments``.
        memory: the run's memory tier (``saving.memory_tier.MemoryTier``), or None.

    Returns:
        The memory checkpoint's path, the same on every rank, or None.
    """
    from trl_ext.process.collectives import decided_on_rank0
    from trl_ext.process.notices import notice

    def decide():
        in_memory, line = newer_in_memory(memory, last_committed(args.output_dir))
        if line:
            notice(f"resume_from_checkpoint=True: {line}" if in_memory else line)
        return in_memory

    return decided_on_rank0(decide) if memory is not None else None


def checkpoint_to_resume(args, wanted, here=None) -> str | None:
    """The checkpoint every rank resumes from: ``wanted`` (a path, or True for the newest committed one), chosen on
    rank 0 and broadcast; refused if some rank cannot see it. Collective when ``args.world_size > 1``.

    Args:
        args: the run's ``TrainingArguments``.
        wanted: ``resume_from_checkpoint`` as given to ``train``: a path, or True.
        here: maps rank 0's path to this machine's (the memory tier's ``MemoryTier.here``: each machine resumes a
            memory checkpoint from its own memory), or None.

    Returns:
        The path on every rank, the same but for a memory checkpoint (each machine its own copy of it; None: no
        checkpoint to resume; Trainer then says so for True).

    Raises:
        ResumeError: the checkpoint is missing where some rank runs.
    """
    from trl_ext.process.collectives import decided_on_rank0, from_every_rank

    path = decided_on_rank0(lambda: last_committed(args.output_dir) if wanted is True else wanted)
    path = here(path) if here is not None else path
    if path is None or args.world_size <= 1:  # one process: the checkpoint's own audit says what is missing
        return path
    missing = [rank for rank, seen in enumerate(from_every_rank(os.path.isdir(path))) if not seen]
    if missing:
        raise ResumeError(f"checkpoint {path} (the one rank 0 resumes) is missing where rank {missing[0]} runs: give "
                          "every node a copy of it, or resume from a checkpoint all nodes have.")
    return path


def after_restart(output_dir: str | os.PathLike) -> tuple[str | None, str] | None:
    """In a run that its orchestrator restarted (or started again into its own directory): the newest committed
    checkpoint of ``output_dir`` if the directory is this run's, and the one line that says so; None otherwise (no
    run identity, another run's directory).

    Args:
        output_dir: the run's output directory.

    Returns:
        ``(checkpoint or None, line)``: None when this run's earlier attempt committed no checkpoint yet.
    """
    if not ownership.is_own(output_dir):
        return None
    job = orchestrators.current()
    last = last_committed(output_dir)
    if last is None:
        return None, f"{job.label}, restart {job.restart}: {output_dir} holds no committed checkpoint yet; training " \
                     "from the start"
    return last, f"{job.label}, restart {job.restart}: resuming from {last}"


def restarted_checkpoint(args, memory=None) -> str | None:
    """``after_restart`` for a trainer, decided on rank 0 and broadcast (collective when ``args.world_size > 1``; call
    it on every rank of a run with an identity), said in one line; the output directory is claimed for this run.

    Args:
        args: the run's ``TrainingArguments``.
        memory: the run's memory tier, or None: its newest checkpoint where it is newer than the disk's.

    Returns:
        The checkpoint to resume, the same on every rank, or None.
    """
    from trl_ext.process.collectives import decided_on_rank0
    from trl_ext.process.notices import notice

    def decide():
        restarted = after_restart(args.output_dir)
        if restarted is not None:
            in_memory, line = newer_in_memory(memory, restarted[0])
            if line:
                job = orchestrators.current()
                notice(f"{job.label}, restart {job.restart}: {line}" if in_memory else line)
            if in_memory:
                ownership.claim(args.output_dir)
                return in_memory
        if restarted is not None and (restarted[0] is not None or orchestrators.current().restart > 0):
            # nothing here, with a mirror: the mirror's resume (resuming/mirrored.py) says what happens instead
            if restarted[0] is not None or not MirrorOptions.of(args).checkpoint_mirror:
                notice(restarted[1])
        ownership.claim(args.output_dir)
        return restarted[0] if restarted is not None else None

    return decided_on_rank0(decide)
