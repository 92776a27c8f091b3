"""The executor: one thread that writes background checkpoints, one at a time, while training goes on.

A ``BackgroundCheckpoint`` is collected on the training thread: its parts are staged (``stage``: their CPU copies in
the snapshot) and queued (``add``), the weights by ``pipeline.save`` and the files other libraries write by
``deferred``. ``Executor.run`` then runs it on the executor's thread (started once, ``thread``), on every rank: it
waits until the copies are complete, writes and checks every part, agrees on every rank's outcome over a gloo process
group of its own (so that its collectives never interleave with training's), and runs the commits (the weights renamed
into the checkpoint, the checkpoint renamed into place, retention). A failure on any rank commits nothing, on every
rank.
"""

import datetime
import enum
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path

import torch.distributed as dist

from trl_ext import errors
from trl_ext.errors import CheckpointError
from trl_ext.process.ranks import distributed
from trl_ext.saving.call_thread import CallThread
from trl_ext.saving.cost import Cost
from trl_ext.saving.snapshot import Snapshot
from trl_ext.saving.write import failed

GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # as the default group's: one transfer or agreement of a checkpoint
Task = Callable[[], "CheckpointError | None"]  # writes and checks one part; returns its failure, never raises


class Purpose(enum.Enum):
    """What a ``BackgroundCheckpoint`` does with the parts it is given."""

    WRITE = "write"  # stage them and write them on the executor's thread: a checkpoint in the background
    RESERVE = "reserve"  # stage them, copied at once, and write nothing: the buffers allocated when training starts
    MEASURE = "measure"  # count the bytes their copies would take, copy nothing


def as_failure(exc: BaseException) -> CheckpointError:
    """Any exception of a checkpoint's part as the ``CheckpointError`` every rank raises."""
    return exc if isinstance(exc, CheckpointError) else failed(f"{type(exc).__name__}: {exc}")


class BackgroundCheckpoint:
    """One checkpoint written in the background: its parts, staged and queued on the training thread, then run by
    the ``Executor``.

    Args:
        target: the directory it commits (``checkpoint-N``).
        executor: runs it (its process group and layouts).
        snapshot: the buffer pool its parts are staged in.
        purpose: ``Purpose.WRITE``, or a reserve or a measure of the copies (nothing is written).
    """

    def __init__(self, target: Path, executor: "Executor", snapshot: Snapshot, purpose: Purpose = Purpose.WRITE):
        self.target, self.executor, self.snapshot, self.purpose = Path(target), executor, snapshot, purpose
        self.parts: list[tuple[str, Task]] = []
        self.commits: list[Callable[[], None]] = []
        self.measured = 0  # Purpose.MEASURE: the bytes the copies would take
        self._measured_storages: set[int] = set()
        self.weight_bytes = 0  # the bytes of this rank's parts of the weights (the layout's sources)
        self.cancelled = False
        self.error: BaseException | None = None  # set by the executor's thread
        self.cost = Cost()  # held_*: the training thread; write_s: the executor's thread; bytes: the commit
        self.copies_waited = False  # the training thread has waited for its copies
        self.memory = False  # a memory checkpoint (memory_checkpoint_steps), not one in the output directory
        self.say_foreground: Callable[[str], None] = lambda why: None  # says, once, why a part is saved at once

    @property
    def name(self) -> str:
        return self.target.name

    def group(self):
        """The process group of the checkpoint's transfers and agreements (None outside a distributed run)."""
        return self.executor.group()

    def layout(self, key, compute: Callable[[], object]):
        """A save's layout, planned once per model (``Executor.layout``)."""
        return self.executor.layout(key, compute)

    def stage(self, obj, key: str):
        """``obj``'s CPU copy (``Snapshot.stage``), or, when measuring, ``obj`` itself with its bytes counted."""
        if self.purpose is Purpose.MEASURE:
            self.measured += Snapshot.measure(obj, self._measured_storages)
            return obj
        return self.snapshot.stage(obj, key, at_once=self.purpose is Purpose.RESERVE)

    def add(self, name: str, task: Task, commit: Callable[[], None] | None = None) -> None:
        """Queue one part (ignored unless ``Purpose.WRITE``).

        Args:
            name: what the part writes (a file or directory name), for ``Executor.events``.
            task: writes and checks it on the executor's thread, after the parts queued before it; returns its failure.
                It runs on every rank that queued it even after an earlier part failed (its transfers are
                collective).
            commit: run once every rank's every part succeeded (the weights renamed into place), in queue order.
        """
        if self.purpose is not Purpose.WRITE:
            return
        self.parts.append((name, task))
        if commit is not None:
            self.commits.append(commit)


class Executor:
    """Runs one ``BackgroundCheckpoint`` at a time on its thread (one for the run), with a gloo process group of its
    own.

    ``events`` records, in order, when each checkpoint started and finished (``("started", name,
    time.monotonic())``, ``("finished", ...)``), when its copies were complete (``"copied"``) and when each part was
    written (``("wrote", part, time)``), for tests and benchmarks.
    """

    def __init__(self):
        self._group = None
        self.thread = CallThread("trl_ext-writes")
        self._running: Future | None = None
        self._layouts: dict = {}
        self.events: list[tuple[str, str, float]] = []

    def group(self):
        """The executor's process group (created on first use, on every rank at the same point; None outside a
        distributed run)."""
        if self._group is None and distributed():
            self._group = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
        return self._group

    def layout(self, key, compute: Callable[[], object]):
        """A save's layout (who writes which file of what), computed once per model and kept: planning it again at
        every checkpoint would hold training for nothing (the model's tensors do not change during training)."""
        if key not in self._layouts:
            self._layouts = {key: compute()}
        return self._layouts[key]

    def running(self) -> bool:
        return self._running is not None and not self._running.done()

    def run(self, checkpoint: BackgroundCheckpoint) -> None:
        """Start writing ``checkpoint`` on the executor's thread (every rank; its copies started)."""
        if self.running():
            raise CheckpointError("a background checkpoint is already in flight: wait for it first", kind="in-flight")
        self.group()  # created here, at the same point on every rank
        self.events.append(("started", checkpoint.name, time.monotonic()))
        self._running = self.thread.submit(self._run, checkpoint)

    def _run(self, checkpoint: BackgroundCheckpoint) -> None:
        """The executor's thread: the copies, every part, the agreement, the commits."""
        start = time.monotonic()
        try:
            copy_error = checkpoint.snapshot.copied()
            error = None if copy_error is None else as_failure(copy_error)
            self.events.append(("copied", checkpoint.name, time.monotonic()))
            for name, task in checkpoint.parts:  # all of them, even after a failure: their transfers are collective
                try:
                    failure = task()
                except BaseException as exc:  # noqa: BLE001 - agreed on below, never left to hang the others
                    failure = as_failure(exc)
                self.events.append(("wrote", name, time.monotonic()))
                error = error or failure
            if checkpoint.cancelled and error is None:
                error = failed(f"{checkpoint.target} was abandoned because training stopped before it was complete; "
                               "earlier checkpoints are intact")
            errors.agree(error, self._group, prefer=(errors.NONFINITE,))
            for commit in checkpoint.commits:
                commit()
            if self._group is not None:
                dist.barrier(group=self._group)  # nobody reads the checkpoint before it is in place
        except BaseException as exc:  # noqa: BLE001 - reported on the training thread, on every rank
            checkpoint.error = exc
        checkpoint.cost.write_s = time.monotonic() - start
        self.events.append(("finished", checkpoint.name, time.monotonic()))

    def join(self, timeout: float | None = None) -> None:
        """Until the checkpoint in flight (if any) is done on this rank, or ``timeout`` seconds."""
        if self._running is not None:
            futures.wait([self._running], timeout)

    def close(self, timeout: float | None = None) -> bool:
        """The thread ended once the checkpoint in flight (if any) is done, waiting at most ``timeout`` seconds; a
        later ``run`` starts it again. No collective call. Returns whether it has ended."""
        return self.thread.close(timeout)
