"""The CPU copies background checkpoints need, reserved once at the end of the first training step (``reserve``):
measured, checked against each machine's available memory (the ranks of one machine added up) and allocated in the
snapshot, so that no checkpoint allocates. Where they do not fit, or some part cannot be copied, checkpoints go to the
foreground (the reason is returned).
"""

import socket
import tempfile
from pathlib import Path

import psutil

from trl_ext.process.collectives import from_every_rank
from trl_ext.saving import deferred, pipeline
from trl_ext.saving.executor import BackgroundCheckpoint, Executor, Purpose
from trl_ext.saving.snapshot import Snapshot
from trl_ext.settings.trainer_options import SaveOptions


def reserve_copies(trainer, executor: Executor, snapshot: Snapshot) -> tuple[int, str | None]:
    """On every rank, at the same point (planning the weights' layout is collective): every copy a checkpoint of
    ``trainer`` needs, measured, checked and allocated; the copies' and the executor's threads and the executor's
    process group started, so that no checkpoint waits for them.

    Args:
        trainer: the trainer, after its first step (its optimizer states exist).
        executor: writes its background checkpoints.
        snapshot: the buffers the copies go to.

    Returns:
        The bytes measured (what was then allocated), and why checkpoints must go to the foreground (None if they
        need not).
    """
    if not pipeline.supports(trainer.model):
        return 0, None
    settings = (SaveOptions.of(trainer.args).max_shard_size, trainer.writes_files())
    measure = BackgroundCheckpoint(Path(), executor, snapshot, Purpose.MEASURE)
    if pipeline.reserve_weights(trainer.model, *settings, measure) is None:
        return 0, pipeline.CANNOT_COPY
    _other_files(trainer, measure)
    short = _short(measure.measured)
    if short:
        return measure.measured, f"their CPU copies need {short}"
    snapshot.begin()
    snapshot.thread.start()
    executor.thread.start()
    executor.group()  # created here, where every rank is, rather than by the first checkpoint
    allocate = BackgroundCheckpoint(Path(), executor, snapshot, Purpose.RESERVE)
    pipeline.reserve_weights(trainer.model, *settings, allocate)
    _other_files(trainer, allocate)
    snapshot.begin()  # what the reserve copied is not kept alive until the first checkpoint
    return measure.measured, None


def _other_files(trainer, checkpoint: BackgroundCheckpoint) -> None:
    """Trainer's own writes of a checkpoint's other files, into a scratch directory, measured or copied."""
    if trainer.args.save_only_model:
        return
    with tempfile.TemporaryDirectory(prefix="trl_ext-reserve-") as scratch, deferred.deferred_writes(checkpoint):
        trainer.write_states(scratch)


def _short(need: int) -> str:
    """Where the CPU copies do not fit in a machine's available memory (its ranks added up), the same on every rank:
    one line saying how much was needed where; empty if they fit everywhere."""
    everyone = from_every_rank((socket.gethostname(), need, psutil.virtual_memory().available))
    short = []
    for host in sorted({h for h, _, _ in everyone}):
        needed = sum(n for h, n, _ in everyone if h == host)
        available = min(a for h, _, a in everyone if h == host)
        if needed > available:
            short.append(f"{needed / 2**30:.2f} GiB on {host}, where {available / 2**30:.2f} GiB is available")
    return "; ".join(short)
