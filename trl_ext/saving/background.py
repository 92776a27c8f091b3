"""Saves in the background: training blocks only while each rank copies its own parts of the checkpoint to CPU
memory; the files are written, synced, checked, agreed on and committed on a thread of their own.

A background save is collected on the training thread, then run on the saves' thread:

1. ``begin`` (every rank): a save is in flight.
2. Its parts are copied and queued (``add``): the weights by ``pipeline.save`` (each rank's ZeRO-3 partitions or FSDP2
   shards, ``engines.sharded.local_copy``), and, inside ``deferring`` around Trainer's ``_save_checkpoint``, every file
   Trainer, DeepSpeed and accelerate write themselves (optimizer and scheduler states, ZeRO partitions, FSDP2's DCP
   shards, RNG states: ``deferred``). The CPU buffers are kept from one save to the next (``reserve`` allocates them
   once, when training starts).
3. ``release`` (every rank) starts the thread: every part is written and checked, every rank's outcome agreed on over
   a gloo process group of the saves' own (so their collectives never interleave with training's), then the commits
   run (the weights renamed into the checkpoint, the checkpoint renamed into place, older ones rotated out).

At most one save is in flight: the next one, the end of training and an error wait for it. Every rank's thread ends
with the same agreed outcome, so the ranks that ask at the same point (``poll`` at a step boundary, ``wait`` before the
next save) raise together: a failed save is reported on every rank, and nothing it left is committed.
"""

import contextlib
import dataclasses
import datetime
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from trl_ext import errors
from trl_ext.engines.sharded import LocalCopy, is_partitioned, local_copy, local_part, streamable
from trl_ext.errors import CheckpointError
from trl_ext.process import notice
from trl_ext.saving import deferred
from trl_ext.saving.snapshot import Snapshot

GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # as the default group's: one transfer or agreement of a save
Task = Callable[[], "CheckpointError | None"]  # writes and checks one part; returns its failure, never raises


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _failed(exc: BaseException) -> CheckpointError:
    return exc if isinstance(exc, CheckpointError) else CheckpointError(
        f"saving failed: {type(exc).__name__}: {exc}", kind="save")


class BackgroundSaves:
    """Runs one save at a time on a thread of its own, and reports its outcome on every rank.

    Create one per training run on every rank; call ``poll`` at every step boundary and ``wait`` before the next save
    and at the end, on every rank (both are collective while a save is in flight). ``events`` records, in order, when
    each save started and finished (``("started", path, time.monotonic())``, then ``"finished"``) and when each part
    was written (``("wrote", name, time)``), for tests and benchmarks.
    """

    def __init__(self):
        pinned = torch.cuda.is_available()  # page-locked: the copies from the GPU run at full speed, asynchronously
        self._group = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._tasks: list[tuple[str, Task]] = []
        self._commits: list[Callable[[], None]] = []
        self._target = ""
        self._cancelled = False
        self.in_flight = False  # the same on every rank: set by ``begin``, cleared by ``wait``
        self.collecting = False  # between ``begin`` and ``release``: parts copied now belong to this save
        self.snapshot = Snapshot(pinned)  # the CPU copies of the files other libraries write
        self.snapshot_bytes = 0  # this rank's CPU copy of the weights for the save in flight (or the last one)
        self.measured = 0  # bytes the other files' copies take, added up by ``deferring("measure")``
        self.events: list[tuple[str, str, float]] = []
        self._layouts: dict = {}
        self._buffers: dict[tuple, torch.Tensor] = {}  # the weights' CPU copies, reused from one save to the next
        self._pinned = pinned
        self._said = False

    def group(self):
        """The process group of the saves' transfers and agreements (created on first use, on every rank at the same
        point; None outside a distributed run)."""
        if self._group is None and _distributed():
            self._group = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
        return self._group

    def layout(self, key, compute: Callable[[], object]):
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

    @staticmethod
    def copy_bytes(weight_sets) -> int | None:
        """The bytes ``copy`` takes on this rank for ``weight_sets`` (None if some source cannot be copied)."""
        world = dist.get_world_size() if _distributed() else 1
        total = 0
        for ws in weight_sets:
            for unit in ws.units:
                for _, tensor in unit.sources:
                    if is_partitioned(tensor):
                        if not streamable(tensor, world):
                            return None
                        part, _ = local_part(tensor, world)
                        total += part.numel() * part.element_size()
                    else:
                        total += tensor.numel() * tensor.element_size()
        return total

    def copy(self, weight_sets):
        """The weight sets with each source replaced by this rank's CPU copy of it (``local_copy``), into buffers kept
        from the previous save. None if some source cannot be copied (the same on every rank: it depends on the
        engine's settings)."""
        if self._alive():
            raise CheckpointError("a background save is already in flight: wait() for it first", kind="in-flight")

        def buffer(key):
            def get(numel: int, dtype: torch.dtype) -> torch.Tensor:
                buf = self._buffers.get(key)
                if buf is None or buf.numel() != numel or buf.dtype != dtype:
                    buf = self._buffers[key] = torch.empty(numel, dtype=dtype, pin_memory=self._pinned)
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
        if on_device and self._pinned:
            torch.cuda.synchronize()  # the asynchronous copies into pinned memory are complete
        self.snapshot_bytes = nbytes
        return copied

    def begin(self, target: str) -> None:
        """Start collecting a save of ``target``, on every rank (its parts are then ``add``-ed, and ``release`` runs
        it). Call once the previous save was waited for (``wait``)."""
        if self._alive() or self.collecting:
            raise CheckpointError("a background save is already in flight: wait() for it first", kind="in-flight")
        self.group()  # created here, at the same point on every rank
        self.in_flight, self.collecting, self._error, self._cancelled = True, True, None, False
        self._tasks, self._commits, self._target = [], [], target
        self.events.append(("started", target, time.monotonic()))

    def add(self, name: str, task: Task, commit: Callable[[], None] | None = None) -> None:
        """Queue one part of the save being collected.

        Args:
            name: what the part writes (a file or directory name), for ``events``.
            task: writes and checks it on the saves' thread, after the parts queued before it; returns its failure.
                It runs on every rank that queued it even after an earlier part failed (its transfers are
                collective).
            commit: run once every rank's every part succeeded (the weights renamed into place), in queue order.
        """
        self._tasks.append((name, task))
        if commit is not None:
            self._commits.append(commit)

    def deferring(self, mode: str = "queue"):
        """Context for the foreground part of a checkpoint: the files other libraries write in it are copied and
        queued (``mode`` "queue"), only copied ("reserve": allocate the buffers) or only measured ("measure")."""
        if mode == "queue" and not self.collecting:
            return contextlib.nullcontext()
        return deferred.deferred_writes(self, mode)

    def release(self, then: Callable[[], None] | None = None) -> None:
        """The save collected since ``begin`` is complete: start writing it, on every rank. ``then`` runs on the
        saves' thread right after its commits (if it fails, ``then`` never runs). With no save collected (it ran in
        the foreground), ``then`` runs now."""
        if not self.collecting:
            if then is not None:
                then()
            return
        self.collecting = False
        if then is not None:
            self._commits.append(then)
        self._thread = threading.Thread(target=self._run, name="trl_ext-save", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """The saves' thread: every part, the agreement, the commits."""
        error = None
        try:
            self.snapshot.wait()  # asynchronous copies from the GPU are complete
            for name, task in self._tasks:
                try:
                    failure = task()
                except BaseException as exc:  # noqa: BLE001 - agreed on below, never left to hang the others
                    failure = _failed(exc)
                self.events.append(("wrote", name, time.monotonic()))
                error = error or failure
            if self._cancelled and error is None:
                error = CheckpointError(f"saving failed: the save of {self._target} was abandoned because training "
                                        "stopped before it was complete; earlier checkpoints are intact", kind="save")
            errors.agree(error, self._group, prefer=(errors.NONFINITE,))
            for commit in self._commits:
                commit()
            if self._group is not None:
                dist.barrier(group=self._group)  # nobody reads the checkpoint before it is in place
        except BaseException as exc:  # noqa: BLE001 - reported on the training thread, on every rank
            self._error = exc
        self.events.append(("finished", self._target, time.monotonic()))

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
        if not self.in_flight or self.collecting:
            return
        running = int(self._alive())
        if _distributed():
            flag = torch.tensor([running], dtype=torch.int64, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            running = int(flag.item())
        if not running:
            self.wait(device)

    def wait(self, device=None) -> None:
        """Wait for the save in flight (if any) and raise its failure, on every rank (a collective then). A save
        collected but never released is dropped: the rest of its checkpoint is not there.

        Args:
            device: the device of the default process group's tensors (default: CPU, for gloo).

        Raises:
            CheckpointError: the background save failed on some rank; nothing of it was committed.
        """
        if not self.in_flight:
            return
        if self.collecting:  # never released: nothing was written, nothing is committed
            self.collecting, self.in_flight, self._tasks, self._commits = False, False, [], []
            return
        if self._thread is not None:
            self._thread.join()
        self.in_flight = False
        error = self._error
        # Every rank's outcome, of its class and kind (the thread's agreement already made them one).
        errors.agree(None if error is None else _failed(error), prefer=(errors.NONFINITE,))

    def abandon(self, timeout: float = 60.0) -> None:
        """Training stopped with an error: the save in flight is not committed if it has not been yet; its thread is
        given ``timeout`` seconds to end. No collective call: the other ranks may be gone."""
        self._cancelled = True
        self.collecting = False
        if self._thread is not None:
            self._thread.join(timeout)
        self.in_flight = False

    def fits(self, need: int) -> tuple[bool, str]:
        """Whether every rank's CPU copies fit in its machine's available memory (ranks on one machine added up), the
        same answer on every rank; and, when not, the one line saying how much was needed."""
        import socket

        import psutil

        mine = (socket.gethostname(), need, psutil.virtual_memory().available)
        everyone = [mine]
        if _distributed():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        short = []
        for host in sorted({h for h, _, _ in everyone}):
            needed = sum(n for h, n, _ in everyone if h == host)
            available = min(a for h, _, a in everyone if h == host)
            if needed > available:
                short.append(f"{needed / 2**30:.2f} GiB on {host}, where {available / 2**30:.2f} GiB is available")
        return not short, "; ".join(short)


class StepBoundary(TrainerCallback):
    """A trainer's background saves: checked at every step boundary (a failure raised on every rank), waited for when
    training ends, and, on a GPU, the CPU copies complete before the next optimizer step changes the originals.

    Args:
        saves: the trainer's background saves.
        first_step: called at the end of the first training step, on every rank (the copies are reserved then).
    """

    def __init__(self, saves: BackgroundSaves, first_step: Callable[[], None] | None = None):
        self.saves, self.first_step = saves, first_step

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.saves.snapshot.wait()

    def on_step_end(self, args, state, control, **kwargs):
        if self.first_step is not None:
            first_step, self.first_step = self.first_step, None
            first_step()
        self.saves.poll(args.device)

    def on_train_end(self, args, state, control, **kwargs):
        self.saves.wait(args.device)
