"""A checkpoint's state copied into CPU buffers that are kept and reused from one checkpoint to the next, so that the
files can be written later, on another thread, while training changes the originals.

The copy preserves what ``torch.save`` writes, so a file saved from the copy is byte for byte the file saved from the
original: ``torch.save`` writes each tensor's whole storage, so a view of a larger flat buffer (ZeRO-2's fp32
partition, the views of DeepSpeed's flat 16-bit model) is copied as the same view of a copy of its whole storage;
tensors sharing a storage share one copied storage; a tensor's attributes (ZeRO-3's ``ds_id``) and an
``OrderedDict``'s ``_metadata`` are copied too. A DTensor (FSDP2) keeps its mesh, placements and global shape around a
copy of this rank's shard. Everything else is ``copy.deepcopy``'d, with one memo, so shared objects stay shared.

Buffers are keyed by the file's name and the storage's position in it, the same from one checkpoint to the next. On a
GPU they are pinned and the copies asynchronous: ``wait`` before the copied tensors are read, or before the originals
change (the next optimizer step).
"""

import copy
from collections import OrderedDict

import torch


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without DTensor
        return None
    return DTensor


class Snapshot:
    """CPU copies of checkpoint states, into buffers kept from one checkpoint to the next.

    Args:
        pinned: allocate page-locked buffers (on a GPU machine: the copies from the GPU run asynchronously).
    """

    def __init__(self, pinned: bool = False):
        self.pinned = pinned
        self._buffers: dict[tuple, torch.UntypedStorage] = {}
        self.allocated = 0  # bytes allocated so far: after the first checkpoint (or a reserve), nothing more
        self._event = None  # on a GPU: recorded after the last copies

    def _buffer(self, key: tuple, nbytes: int) -> torch.UntypedStorage:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.nbytes() != nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned).untyped_storage()
            self._buffers[key] = buffer
            self.allocated += nbytes
        return buffer

    @staticmethod
    def measure(obj) -> int:
        """The bytes ``copy`` would hold for ``obj`` (each distinct storage once; a DTensor's local shard)."""
        dtensor, seen, total = _dtensor_class(), set(), 0

        def walk(o):
            nonlocal total
            if dtensor is not None and isinstance(o, dtensor):
                o = o._local_tensor
            if isinstance(o, torch.Tensor):
                storage = o.untyped_storage()
                if storage._cdata not in seen:
                    seen.add(storage._cdata)
                    total += storage.nbytes()
            elif isinstance(o, dict):
                for v in o.values():
                    walk(v)
            elif isinstance(o, (list, tuple)):
                for v in o:
                    walk(v)

        walk(obj)
        return total

    @torch.no_grad()
    def copy(self, obj, key: str):
        """A copy of ``obj`` with every tensor in this snapshot's CPU buffers (see the module docstring).

        Args:
            obj: what a save writes (a state dict, nested in dicts, lists and tuples).
            key: the file's name, the same at every checkpoint (buffers are reused by it).

        Returns:
            The copy, which ``torch.save`` writes to the same bytes as ``obj``.
        """
        dtensor = _dtensor_class()
        storages: dict[int, torch.UntypedStorage] = {}  # the source storage (as torch.save keys them) -> its copy
        memo: dict[int, object] = {}
        count = [0]

        def tensor(x: torch.Tensor) -> torch.Tensor:
            source = x.untyped_storage()
            target = storages.get(source._cdata)
            if target is None:
                target = self._buffer((key, count[0]), source.nbytes())
                count[0] += 1
                if source.nbytes():
                    target.copy_(source, non_blocking=self.pinned and source.device.type != "cpu")
                storages[source._cdata] = target
            y = torch.empty(0, dtype=x.dtype).set_(target, x.storage_offset(), x.size(), x.stride())
            if isinstance(x, torch.nn.Parameter):
                y = torch.nn.Parameter(y, requires_grad=x.requires_grad)
            elif x.requires_grad:
                y.requires_grad_(True)
            memo[id(x)] = y
            for name, value in getattr(x, "__dict__", {}).items():  # ZeRO-3's ds_id: torch.save pickles it
                setattr(y, name, walk(value))
            return y

        def walk(o):
            if id(o) in memo:
                return memo[id(o)]
            if dtensor is not None and isinstance(o, dtensor):  # FSDP2: this rank's shard, as placed
                copied = dtensor.from_local(tensor(o._local_tensor), o.device_mesh, o.placements, run_check=False,
                                            shape=o.shape, stride=o.stride())
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

        result = walk(obj)
        if self.pinned and torch.cuda.is_available():
            self._event = torch.cuda.Event()
            self._event.record()
        return result

    def wait(self) -> None:
        """Until the asynchronous copies (pinned buffers on a GPU) are complete; at once on a CPU. Both the saves'
        thread (before it writes) and the training thread (before the next optimizer step) wait: the event stays, so
        neither finds it gone while the other waits."""
        event = self._event
        if event is not None:
            event.synchronize()
