"""A checkpoint's state copied into CPU buffers kept from one checkpoint to the next (the one buffer pool of
background checkpoints), so that its files can be written on another thread while training goes on, and copied while
the next forward and backward run.

``stage`` walks what a part writes, on the training thread: it builds the CPU copy's structure around buffers of the
pool, copies small tensors at once and queues the others. ``start`` runs the queued copies beside training: on a CUDA
stream of their own for GPU tensors (after an event recorded on the compute stream, so they copy the values of the
checkpoint's step), on a thread for tensors in CPU memory (so the CPU-only tests exercise the same ordering).
``wait_for_copies`` ends them before anything changes the originals; the executor's thread ends them (``copied``)
before it writes.

What changes the originals in place, and so waits for the copies (``wait_for_copies`` runs as a step pre-hook of the
torch optimizer under every engine's wrappers, ``saving.checkpoints``):

- the optimizer step: the trained weights, their fp32 masters, the optimizer's moments and step counts. It runs only
  at a gradient-accumulation boundary, so the copies may overlap several micro-batches' forward and backward;
- DeepSpeed's ``engine.step()``, which accelerate calls inside ``backward`` (before Trainer's own
  ``on_pre_optimizer_step``): after the optimizer step it rewrites the 16-bit partitions (ZeRO-3's ``ds_tensor``) and
  ZeRO-1/2's flat 16-bit buffers from the fp32 masters. The pre-hook on the optimizer it wraps runs before both;
- FSDP2's sharded parameters (each DTensor's local shard): the optimizer step updates them; forward and backward only
  read them to all-gather.

Copied at once instead, on the training thread (in the compute stream's order on a GPU): what changes outside the
optimizer step, the model's buffers (``copy_at_once``: a forward pass may update them, as BatchNorm's running
statistics), and every tensor of at most ``SMALL_BYTES`` (counters, scalars: cheaper at once). The rest of what a
checkpoint holds does not change before the optimizer step: the RNG states are new tensors (the generators' state is
copied by ``get_rng_state``), the scheduler's state and loss scalers are numbers (copied with the structure), the
trainer state is JSON written at once. Gradients are not part of a checkpoint.

The copy preserves what ``torch.save`` writes, so a file saved from the copy is byte for byte the file saved from the
original: ``torch.save`` writes each tensor's whole storage, so a view of a larger flat buffer (ZeRO-2's fp32
partition, the views of DeepSpeed's flat 16-bit model) is copied as the same view of a copy of its whole storage.
Storages are copied once per checkpoint, whichever file or part meets them first: tensors sharing a storage share one
copied storage, and ZeRO-2's weights (the safetensors) and DeepSpeed's model states (``mp_rank_00_model_states.pt``,
the same flat buffers) share one copy. A tensor's attributes (ZeRO-3's ``ds_id``) and an ``OrderedDict``'s
``_metadata`` are copied too. A DTensor (FSDP2) keeps its mesh, placements and global shape around a copy of this
rank's shard. Everything else is ``copy.deepcopy``'d, with one memo, so shared objects stay shared.

Buffers are keyed by the part's name and the storage's position in it, the same from one checkpoint to the next, and
pinned on a GPU machine (copies from the GPU run asynchronously only into page-locked memory).
"""

import copy
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures

import torch

from trl_ext import patches
from trl_ext.saving.call_thread import CallThread

SMALL_BYTES = 4 << 10  # at most this, a tensor is copied at once (counters, scalars): a queued copy costs more


def _view_in(x: torch.Tensor, target: torch.UntypedStorage) -> torch.Tensor:
    """``x``'s view (offset, size, stride, parameter or not, requires_grad) over the copy ``target`` of its storage."""
    y = torch.empty(0, dtype=x.dtype).set_(target, x.storage_offset(), x.size(), x.stride())
    if isinstance(x, torch.nn.Parameter):
        y = torch.nn.Parameter(y, requires_grad=x.requires_grad)
    elif x.requires_grad:
        y.requires_grad_(True)
    return y


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without DTensor
        return None
    return DTensor


class _Copies:
    """One checkpoint's queued copies, running beside training: GPU sources on ``stream``, CPU ones on a thread."""

    def __init__(self, queued: list[tuple[torch.UntypedStorage, torch.UntypedStorage]], stream,
                 on_copies: Callable[[str], None] | None, thread: CallThread):
        # ``stream`` is None unless some source is on the GPU (the small ones were copied on the compute stream)
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.ended: float | None = None
        self._event = None  # recorded on ``stream`` after the GPU copies
        self._waited_on_gpu = None  # recorded on the compute stream where the optimizer step waited for them
        gpu = [(t, s) for t, s in queued if s.device.type != "cpu"]
        cpu = [(t, s) for t, s in queued if s.device.type == "cpu"]
        if stream is not None:
            ready = torch.cuda.Event()
            ready.record()  # the compute stream's work so far: the values of the checkpoint's step
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                for target, source in gpu:
                    target.copy_(source, non_blocking=True)
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record(stream)
        self._copying = thread.submit(self._copy, cpu, on_copies) if cpu or on_copies is not None else None

    def _copy(self, pairs, on_copies) -> None:
        try:
            if on_copies is not None:
                on_copies("start")  # tests: copies slowed on purpose
            for target, source in pairs:
                target.copy_(source)
            if on_copies is not None:
                on_copies("end")
        except BaseException as exc:  # noqa: BLE001 - reported by the executor's thread, on every rank
            self.error = exc
        self.ended = time.monotonic()

    def done(self) -> bool:
        return (self._copying is None or self._copying.done()) and (self._event is None or self._event.query())

    def wait_for_training(self) -> None:
        """Before the originals change: the CPU copies joined; the GPU ones ordered before the compute stream's next
        work (the host does not wait for them)."""
        if self._copying is not None:
            futures.wait([self._copying])
        if self._event is not None and self._waited_on_gpu is None:
            self._waited_on_gpu = torch.cuda.Event(enable_timing=True)
            self._waited_on_gpu.record()
            torch.cuda.current_stream().wait_event(self._event)

    def wait(self) -> None:
        """Until every copy is complete (the executor's thread, before it reads them)."""
        if self._copying is not None:
            futures.wait([self._copying])
        if self._event is not None:
            self._event.synchronize()

    def gpu_stall(self) -> float:
        """Seconds the compute stream waited for the GPU copies before the optimizer step (0 if they were done)."""
        if self._event is None or self._waited_on_gpu is None:
            return 0.0
        self._event.synchronize()
        self._waited_on_gpu.synchronize()
        return max(0.0, self._waited_on_gpu.elapsed_time(self._event) / 1000)


class Snapshot:
    """CPU copies of checkpoint states, into buffers kept from one checkpoint to the next.

    Args:
        pinned: allocate page-locked buffers (on a GPU machine: the copies from the GPU run asynchronously).
    """

    def __init__(self, pinned: bool = False):
        self.pinned = pinned
        self._buffers: dict[tuple, torch.UntypedStorage] = {}
        self.allocated = 0  # bytes allocated so far: after the first checkpoint (or a reserve), nothing more
        self.nbytes = 0  # the bytes this checkpoint's copies take
        self.on_copies: Callable[[str], None] | None = None  # tests: called on the copies' thread ("start", "end")
        self.copy_at_once: set[int] = set()  # storages (``storage_key``) that change outside the optimizer step
        self.thread = CallThread("trl_ext-copies")
        self._stream = None
        # The copies' tensors, kept from one checkpoint to the next: a copy is a view of a buffer with the source's
        # geometry, so the same buffer and geometry give the same tensor, reused rather than built again at every
        # checkpoint while training waits (FSDP2's DTensors cost most). Those the last checkpoint did not use are
        # dropped, with the buffers they hold.
        self._views: dict[tuple, torch.Tensor] = {}
        self._views_before: dict[tuple, torch.Tensor] = {}
        self._begin()

    def _begin(self) -> None:
        # source storage (torch.save's key) -> (the source, kept alive until copied; its copy)
        self._storages: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        self._counts: dict[str, int] = {}
        self._queued: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        self._copies: _Copies | None = None
        self._on_gpu = False  # some source is on the GPU: the copies end with an event of their stream
        self.nbytes = 0
        if self._views:
            self._views_before, self._views = self._views, {}

    def begin(self) -> None:
        """A new checkpoint: the previous one's copies are complete (the executor's thread waited for them), its buffers
        are reused."""
        if self._copies is not None:
            self._copies.wait()
        self._begin()

    def _buffer(self, key: tuple, nbytes: int) -> torch.UntypedStorage:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.nbytes() != nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned).untyped_storage()
            self._buffers[key] = buffer
            self.allocated += nbytes
        return buffer

    @staticmethod
    def measure(obj, seen: set[int] | None = None) -> int:
        """The bytes ``stage`` would hold for ``obj``: each distinct storage once (not counting those in ``seen``, which
        it adds to: a checkpoint copies a storage once, whichever part meets it first); a DTensor's local shard."""
        dtensor, total = _dtensor_class(), 0
        seen = set() if seen is None else seen

        def walk(o):
            nonlocal total
            if dtensor is not None and isinstance(o, dtensor):
                o = dtensor_shard(o)
            if isinstance(o, torch.Tensor):
                storage = o.untyped_storage()
                if storage_key(storage) not in seen:
                    seen.add(storage_key(storage))
                    total += storage.nbytes()
            elif isinstance(o, dict):
                for v in o.values():
                    walk(v)
            elif isinstance(o, (list, tuple)):
                for v in o:
                    walk(v)

        walk(obj)
        return total

    def _storage_copy(self, source: torch.UntypedStorage, key: str, at_once: bool) -> torch.UntypedStorage:
        identity = storage_key(source)
        found = self._storages.get(identity)
        if found is not None:
            return found[1]
        count = self._counts.get(key, 0)
        self._counts[key] = count + 1
        target = self._buffer((key, count), source.nbytes())
        self._storages[identity] = (source, target)
        self.nbytes += source.nbytes()
        self._on_gpu = self._on_gpu or source.device.type != "cpu"
        if source.nbytes():
            if at_once or source.nbytes() <= SMALL_BYTES or identity in self.copy_at_once:
                # on a GPU, in the compute stream's order: before the next forward changes a buffer
                target.copy_(source, non_blocking=self.pinned and source.device.type != "cpu")
            else:
                self._queued.append((target, source))
        return target

    def _view(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The copy's tensor for ``key`` (its buffer and geometry): the one the last checkpoint used, or ``make()``."""
        view = self._views.get(key)
        if view is None:
            view = self._views_before.pop(key, None)
            if view is None:
                view = make()
            self._views[key] = view
        return view

    @torch.no_grad()
    def stage(self, obj, key: str, at_once: bool = False):
        """A copy of ``obj`` with every tensor in this snapshot's CPU buffers (see the module docstring): the small
        ones copied now, the others once ``start`` runs them.

        Args:
            obj: what a save writes (a tensor, or a state dict nested in dicts, lists and tuples).
            key: the part's name, the same at every checkpoint (buffers are reused by it).
            at_once: copy everything now (reserving the buffers when training starts).

        Returns:
            The copy, which ``torch.save`` writes to the same bytes as ``obj`` once the copies are complete.
        """
        dtensor = _dtensor_class()
        memo: dict[int, object] = {}

        def tensor(x: torch.Tensor) -> torch.Tensor:
            target = self._storage_copy(x.untyped_storage(), key, at_once)
            attributes = getattr(x, "__dict__", None)
            if attributes:  # ZeRO-3's ds_id: torch.save pickles it; copied at every checkpoint
                y = memo[id(x)] = _view_in(x, target)
                for name, value in attributes.items():
                    setattr(y, name, walk(value))
                return y
            geometry = (id(target), x.storage_offset(), tuple(x.size()), tuple(x.stride()), x.dtype,
                        isinstance(x, torch.nn.Parameter), x.requires_grad)
            y = memo[id(x)] = self._view(geometry, lambda: _view_in(x, target))
            return y

        def walk(o):
            if id(o) in memo:
                return memo[id(o)]
            if dtensor is not None and isinstance(o, dtensor):  # FSDP2: this rank's shard, as placed
                local = tensor(dtensor_shard(o))
                placed = ("dtensor", id(local), o.device_mesh, tuple(o.placements), tuple(o.shape), tuple(o.stride()))
                copied = self._view(placed, lambda: dtensor.from_local(
                    local, o.device_mesh, o.placements, run_check=False, shape=o.shape, stride=o.stride()))
            elif isinstance(o, torch.Tensor):
                return tensor(o)
            elif type(o) in (dict, OrderedDict):
                copied = memo[id(o)] = type(o)()
                for k, v in o.items():
                    copied[k] = walk(v)
                for name, value in getattr(o, "__dict__", {}).items():  # a state dict's _metadata
                    setattr(copied, name, walk(value))
                return copied
            elif type(o) is list:
                copied = memo[id(o)] = []
                copied.extend(walk(v) for v in o)
                return copied
            elif type(o) is tuple:
                items = [walk(v) for v in o]
                copied = o if all(a is b for a, b in zip(items, o)) else tuple(items)
            else:  # scalars, strings, torch.Size, dtypes, DeepSpeed's small objects: with the shared memo
                copied = copy.deepcopy(o, memo)
            memo[id(o)] = copied
            return copied

        return walk(obj)

    def start(self) -> None:
        """Run the queued copies beside training (see the module docstring); at once if there are none."""
        if self._copies is not None:
            return
        if self._on_gpu and self._stream is None:
            self._stream = torch.cuda.Stream()
        self._copies = _Copies(self._queued, self._stream if self._on_gpu else None, self.on_copies, self.thread)
        self._queued = []

    def wait_for_copies(self) -> float:
        """On the training thread, before anything changes the originals (the next optimizer step): the copies are
        complete (CPU), or ordered before the compute stream's next work (GPU, without blocking the host).

        Returns:
            The seconds the training thread waited.
        """
        if self._copies is None:
            return 0.0
        start = time.monotonic()
        self._copies.wait_for_training()
        return time.monotonic() - start

    def copied(self) -> BaseException | None:
        """On the executor's thread, before it writes: waits until every copy is complete.

        Returns:
            What a copy raised, or None.
        """
        if self._copies is None:
            return None  # nothing was staged
        self._copies.wait()
        return self._copies.error

    def in_flight(self) -> bool:
        """Whether copies were started and are not complete."""
        return self._copies is not None and not self._copies.done()

    def gpu_stall(self) -> float:
        """Seconds the GPU's compute stream waited for this checkpoint's copies before the optimizer step."""
        return self._copies.gpu_stall() if self._copies is not None else 0.0

    def close(self, timeout: float | None = None) -> bool:
        """The copies' thread ended once the copies started are done (waiting at most ``timeout`` seconds); a later
        ``start`` starts it again. Returns whether it has ended."""
        return self.thread.close(timeout)


def storage_key(storage) -> int:
    """A storage's identity, the same for every Python object that stands for it, as ``torch.save`` keys storages
    (patch ``storage-identity``); where the release moved it, the address of its data (unique among live storages
    that hold bytes)."""
    return storage._cdata if patches.applies("storage-identity") else storage.data_ptr()


def dtensor_shard(dtensor):
    """The local shard a DTensor holds, the same tensor object at every call (patch ``dtensor-local-tensor``);
    where the release moved it, ``to_local()`` without autograd."""
    local = getattr(dtensor, "_local_tensor", None)
    if local is not None and patches.applies("dtensor-local-tensor"):
        return local
    import torch

    with torch.no_grad():
        return dtensor.to_local()
