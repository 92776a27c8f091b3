"""Resuming from the checkpoint mirror (``checkpoint_mirror``): a run whose output directory holds no committed
checkpoint (a fresh machine, a deleted directory) downloads the newest complete mirrored one, checked against its
manifest, and resumes from it as from a local one. Asked for with ``resume_from_checkpoint=True``; a restarted run (a
requeued Slurm job, recreated pods, a recovered SkyPilot task) whose mirror this run was writing does it by itself.

Decided on rank 0 and broadcast (a mismatching checkpoint refused there, the next older one tried); a failure is
raised on every rank.
"""

from trl_ext.errors import MirrorError, TrlExtError
from trl_ext.mirror import downloader, lease
from trl_ext.mirror.store import first_line
from trl_ext.placement import orchestrators
from trl_ext.process.collectives import decided_on_rank0
from trl_ext.process.notices import notice
from trl_ext.resuming.choose import last_committed


def _from_rank0(decide) -> str | None:
    """``decide()`` on rank 0 (a path or None), broadcast; its failure raised on every rank, as a ``MirrorError`` where
    it is not one of trl_ext's own."""

    def deciding():
        try:
            return decide()
        except TrlExtError:
            raise
        except Exception as exc:  # noqa: BLE001 - a store's own error, said in one line
            raise MirrorError(f"checkpoint_mirror: {first_line(exc)}") from None

    return decided_on_rank0(deciding)


def _download(trainer) -> str | None:
    store = trainer.mirror.store
    notice(f"{trainer.args.output_dir} holds no committed checkpoint: looking in the mirror {store.shown}")
    path = downloader.newest(store, trainer.args.output_dir, notice)
    if path is None:
        notice(f"the mirror {store.shown} holds no complete checkpoint that matches its manifest")
    return None if path is None else str(path)


def download_if_missing(trainer) -> str | None:
    """With ``resume_from_checkpoint=True`` and a mirror: when the output directory holds no committed checkpoint, the
    newest complete mirrored one, downloaded, checked and committed there. Collective.

    Args:
        trainer: the trainer (its ``mirror``; the download runs on global rank 0, which writes the shared output
            directory).

    Returns:
        The local checkpoint, the same on every rank; None when there is no mirror, the output directory already
        holds a checkpoint, or the mirror holds none.

    Raises:
        MirrorError: the store failed while downloading.
    """
    if getattr(trainer, "mirror", None) is None:
        return None
    # The local check is rank 0's too: its download commits a checkpoint that a slower rank would otherwise find, and
    # skip the broadcast rank 0 waits in (a collective mismatch, seen in a 2-process FSDP2 run).
    return _from_rank0(lambda: None if args_has_local_checkpoint(trainer.args) else _download(trainer))


def args_has_local_checkpoint(args) -> bool:
    return last_committed(args.output_dir) is not None


def restarted(trainer) -> str | None:
    """In a run with an identity (a Slurm job, a SkyPilot task, a TrainJob, ...; ``placement.orchestrators``) whose
    output directory holds no checkpoint (a node-local directory gone with its machine, recreated pods, a recovered
    task on a new machine): if the mirror's run marker says this run was writing to it, the newest complete mirrored
    checkpoint, downloaded and checked. Collective.

    Returns:
        The local checkpoint to resume, the same on every rank, or None.
    """
    job = orchestrators.current()
    mirror = getattr(trainer, "mirror", None)
    if mirror is None or job is None or job.run is None:
        return None

    def decide():
        if args_has_local_checkpoint(trainer.args):  # on rank 0 only, as in download_if_missing
            return None
        if not lease.held_by_this_job(mirror.store):
            if job.restart:
                notice(f"{job.label}, restart {job.restart}: neither {trainer.args.output_dir} nor the mirror "
                       f"{mirror.store.shown} holds a checkpoint of this run; training from the start")
            return None
        notice(f"{job.label}, restart {job.restart}: {trainer.args.output_dir} holds no committed checkpoint; this "
               f"run's mirror {mirror.store.shown} is the place to resume from")
        return _download(trainer)

    return _from_rank0(decide)


def start_fresh(trainer) -> bool:
    """With a mirror, ``resume_from_checkpoint=True`` that finds no checkpoint in the output directory or the mirror
    starts a new run (said in one line) instead of failing: one command serves a spot machine's first start and every
    restart. Without a mirror, Trainer's own error stands.

    Returns:
        Whether the run starts from the beginning.
    """
    if getattr(trainer, "mirror", None) is None:
        return False
    notice(f"resume_from_checkpoint=True: neither {trainer.args.output_dir} nor the mirror {trainer.mirror.url} "
           "holds a complete checkpoint yet; starting a new run")
    return True
