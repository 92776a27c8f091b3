"""Saves in the background: training blocks only while each rank copies its own part of the weights to CPU memory.

``pipeline.save(..., background=saves)`` plans the save, stages the directory and takes the copies on the calling
thread, then hands the rest (the exchange between ranks, the writes, fsync, the checks, the agreement and the rename)
to ``BackgroundSaves``' thread. Its transfers and agreements run on a gloo process group of their own, so they never
interleave with training's collectives. At most one save is in flight: the next one, the end of training and an error
wait for it.

Every rank's thread ends with the same agreed outcome (the save's own agreement), so the ranks that ask at the same
point (``poll`` at a step boundary, ``wait`` before the next save) raise together: a failed save is reported on every
rank, and nothing it left is committed. A Trainer checkpoint (``checkpoint-N``: weights, optimizer states, RNG and
trainer state) is started ``held``: its weights are committed into it, and it is renamed into place and older
checkpoints rotated out, only once the foreground has written the rest (``release``).
"""

import dataclasses
import datetime
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from trl_ext import errors
from trl_ext.engines.sharded import LocalCopy, local_copy
from trl_ext.errors import CheckpointError
from trl_ext.files.commit import commit
from trl_ext.process import notice

GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # as the default group's: one transfer or agreement of a save


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class BackgroundSaves:
    """Runs one save at a time on a thread of its own, and reports its outcome on every rank.

    Create one per training run on every rank; call ``poll`` at every step boundary and ``wait`` before the next save
    and at the end, on every rank (both are collective while a save is in flight). ``events`` records, in order, when
    each save started and finished (``("started", path, time.monotonic())``, then ``"finished"``), for tests and
    benchmarks.
    """

    def __init__(self):
        self._group = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._released = threading.Event()
        self._then: Callable[[], None] | None = None
        self._held = False  # a held save was started on this rank and not released yet
        self._cancelled = False
        self.in_flight = False  # the same on every rank: set by ``start``, cleared by ``wait``
        self.snapshot_bytes = 0  # this rank's CPU copy for the save in flight (or the last one)
        self.events: list[tuple[str, str, float]] = []
        self._layouts: dict = {}
        self._buffers: dict[tuple, torch.Tensor] = {}  # the CPU copies, reused from one save to the next
        self._said = False

    def group(self):
        """The process group of the saves' transfers and agreements (created on first use, on every rank; None
        outside a distributed run)."""
        if self._group is None and _distributed():
            self._group = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
        return self._group

    def layout(self, key, compute: Callable[[], tuple]) -> tuple:
        """A save's layout (who writes which file of what), computed once per model and kept: planning it again at
        every checkpoint would block training for nothing (the model's tensors do not change during training)."""
        if key not in self._layouts:
            self._layouts = {key: compute()}
        return self._layouts[key]

    def say_foreground(self, why: str) -> None:
        """Say once that saves run in the foreground, and why."""
        if not self._said:
            self._said = True
            notice(f"save_in_background: checkpoints are saved in the foreground, because {why}.")

    def copy(self, weight_sets):
        """The weight sets with each source replaced by this rank's CPU copy of it (``local_copy``), into
        buffers kept from the previous save: the only step of a background save that blocks training. None if some
        source cannot be copied (the same on every rank: it depends on the engine's settings)."""
        if self._alive():
            raise CheckpointError("a background save is already in flight: wait() for it first", kind="in-flight")
        pinned = torch.cuda.is_available()  # page-locked: the copy from the GPU runs at full speed

        def buffer(key):
            def get(numel: int, dtype: torch.dtype) -> torch.Tensor:
                buf = self._buffers.get(key)
                if buf is None or buf.numel() != numel or buf.dtype != dtype:
                    buf = self._buffers[key] = torch.empty(numel, dtype=dtype, pin_memory=pinned)
                return buf
            return get

        copied, nbytes, on_device = [], 0, False
        for ws in weight_sets:
            units = []
            for unit in ws.units:
                sources = []
                for name, tensor in unit.sources:
                    on_device = on_device or getattr(tensor, "device", torch.device("cpu")).type != "cpu"
                    copy = local_copy(tensor, buffer((ws.subdir, name)))
                    if copy is None:
                        return None
                    part = copy.part if isinstance(copy, LocalCopy) else copy
                    nbytes += part.numel() * part.element_size()
                    sources.append((name, copy))
                units.append(dataclasses.replace(unit, sources=sources))
            copied.append(dataclasses.replace(ws, units=units))
        if on_device and pinned:
            torch.cuda.synchronize()  # the asynchronous copies into pinned memory are complete
        self.snapshot_bytes = nbytes
        return copied

    def start(self, work: Callable[[], None], target: str, held: bool = False) -> None:
        """Run ``work`` (the rest of a save, which raises ``CheckpointError`` on every rank if any rank failed) on the
        saves' thread. Call on every rank that takes part, once the previous save was waited for (``wait``).

        Args:
            work: the save's remaining steps; it commits through ``commit``.
            target: the directory the save commits (for ``events``).
            held: commit only once ``release`` is called (a checkpoint whose other files are still being written).
        """
        if self._alive():
            raise CheckpointError("a background save is already in flight: wait() for it first", kind="in-flight")
        self.in_flight, self._error = True, None
        self._held, self._then, self._cancelled = held, None, False
        if held:
            self._released.clear()
        else:
            self._released.set()
        self.events.append(("started", target, time.monotonic()))

        def run():
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - reported on the training thread, on every rank
                self._error = exc
            self.events.append(("finished", target, time.monotonic()))

        self._thread = threading.Thread(target=run, name="trl_ext-save", daemon=True)
        self._thread.start()

    def release(self, then: Callable[[], None] | None = None) -> None:
        """The held save may commit; ``then`` runs right after its commit, on its thread (if it fails, ``then`` never
        runs). If no held save was started on this rank (it ran in the foreground, or this rank writes nothing),
        ``then`` runs now."""
        if not self._held:
            if then is not None:
                then()
            return
        self._held, self._then = False, then
        self._released.set()

    def commit(self, staging: Path, target: Path) -> None:
        """The commit of a save run by ``start``: once released when held, followed by ``release``'s ``then``."""
        self._released.wait()
        if self._cancelled:
            raise CheckpointError(f"saving failed: the save of {target} was abandoned because training stopped before "
                                  "it was complete; earlier checkpoints are intact", kind="save")
        commit(staging, target)
        if self._then is not None:
            self._then()

    def mark_in_flight(self, target: str) -> None:
        """A save started on other ranks that this rank takes no part in (it writes nothing, with whole
        parameters): it still answers ``poll`` and ``wait`` like the others."""
        self.in_flight = True
        self.events.append(("started", target, time.monotonic()))

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def poll(self, device) -> None:
        """At a step boundary, on every rank: if the save in flight has finished on every rank, its outcome; a failure
        is raised on every rank. One all-reduce of one number while a save is in flight; nothing otherwise.

        Args:
            device: the device of the default process group's tensors (``TrainingArguments.device``).

        Raises:
            CheckpointError: the background save failed; nothing of it was committed.
        """
        if not self.in_flight:
            return
        running = int(self._alive())
        if _distributed():
            flag = torch.tensor([running], dtype=torch.int64, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            running = int(flag.item())
        if not running:
            self.wait(device)

    def wait(self, device=None) -> None:
        """Wait for the save in flight (if any) and raise its failure, on every rank (a collective then).

        Args:
            device: the device of the default process group's tensors (default: CPU, for gloo).

        Raises:
            CheckpointError: the background save failed on some rank; nothing of it was committed.
        """
        if not self.in_flight:
            return
        if self._held:  # never released: the rest of its checkpoint is not there, so it must not be committed
            self._cancelled, self._held = True, False
            self._released.set()
        if self._thread is not None:
            self._thread.join()
        self.in_flight = False
        error = self._error
        if error is not None and not isinstance(error, CheckpointError):  # not one of the save's own: say what
            error = CheckpointError(f"saving failed: {type(error).__name__}: {error}", kind="save")
        # Every rank's outcome, of its class and kind: a commit can fail on the one rank that commits.
        errors.agree(error, prefer=(errors.NONFINITE,))

    def abandon(self, timeout: float = 60.0) -> None:
        """Training stopped with an error: the save in flight is not committed if it has not been yet; its thread is
        given ``timeout`` seconds to end. No collective call: the other ranks may be gone."""
        self._cancelled, self._held = True, False
        self._released.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.in_flight = False


class StepBoundary(TrainerCallback):
    """A trainer's background saves, checked at every step boundary (a failure raised on every rank) and waited for
    when training ends."""

    def __init__(self, saves: BackgroundSaves):
        self.saves = saves

    def on_step_end(self, args, state, control, **kwargs):
        self.saves.poll(args.device)

    def on_train_end(self, args, state, control, **kwargs):
        self.saves.wait(args.device)
