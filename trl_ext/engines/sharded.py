"""A sharded model's parameters as DeepSpeed ZeRO-3 and FSDP2 hold them: what each rank has, the full shapes, whole
tensors one module at a time, and a copy of a rank's own part.

Under ZeRO-3 each rank holds a slice of every parameter (``param.ds_tensor``: the flattened parameter cut into equal,
zero-padded parts, rank ``r`` holding part ``r``) and an empty ``(0,)`` placeholder in ``param.data``; the full
shape is ``param.ds_shape``. Under FSDP2 each parameter is a ``DTensor``: with the usual ``Shard(0)`` placement on a
one-dimensional mesh, rank ``r`` holds the ``r``-th ``torch.chunk`` of its rows (``to_local()``), and the full shape
is ``tensor.shape``. Parts that are not plain tensors in memory (NVMe offload, quantized weights, partition groups
smaller than the world, 2-D meshes) are read whole instead: ``gathered`` (ZeRO-3) and ``FsdpUnits`` (FSDP2).

Used by saving (which streams the parts to the ranks that write), by resuming and by the merged-weights walk.
"""

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trl_ext import patches


@dataclass
class LocalCopy:
    """A partitioned tensor as this rank held it when a background save started: its own part, flattened, in CPU
    memory, and how many elements of its full contents each rank holds (padding excluded), in rank order."""

    part: torch.Tensor
    owned: list[int]
    shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.part.dtype


def is_zero3(tensor: torch.Tensor) -> bool:
    """A ZeRO-3 parameter (whether or not it is currently gathered)."""
    return hasattr(tensor, "ds_id")


def is_dtensor(tensor: torch.Tensor) -> bool:
    """A DTensor: an FSDP2 parameter (sharded across ranks) or any other distributed tensor."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def is_partitioned(tensor: torch.Tensor) -> bool:
    """A tensor whose contents are spread over the ranks (ZeRO-3 or FSDP2): reading it takes every rank."""
    return isinstance(tensor, LocalCopy) or is_zero3(tensor) or is_dtensor(tensor)


def full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    if isinstance(tensor, LocalCopy):
        return tensor.shape
    return tuple(tensor.ds_shape) if is_zero3(tensor) else tuple(tensor.shape)  # a DTensor's shape is the global one


def has_partitioned_params(model: torch.nn.Module) -> bool:
    """True if some parameter is currently a ZeRO-3 placeholder (saving it as-is would write empty tensors)."""
    first = next(model.parameters(), None)
    if first is None or not is_zero3(first):
        # ZeRO-3 partitions the whole model (zero.Init, then deepspeed.initialize for parameters added later), so
        # a model whose first parameter is whole has none partitioned; this skips walking a large module tree.
        return False
    return any(is_zero3(p) and p.numel() == 0 and p.ds_numel > 0 for p in model.parameters())


def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict`` names mapped to the live parameters and buffers (not detached copies), tied weights once."""
    tensors, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied weights (lm_head = embed_tokens): keep the first name, as from_pretrained expects
            continue
        seen.add(id(tensor))
        tensors[name] = tensor
    return tensors


def module_tensors(module: torch.nn.Module, recurse: bool = True) -> dict[str, torch.Tensor]:
    """What ``module.state_dict(keep_vars=True)`` holds (parameters and persistent buffers, by name; with
    ``recurse=False`` the module's own only), read without the state-dict hooks: FSDP2's reshard the unit, so inside
    ``FsdpUnits.unsharded`` they would return its shards."""
    tensors = {}
    owners = module.named_modules(remove_duplicate=False) if recurse else [("", module)]
    for prefix, owner in owners:
        dot = f"{prefix}." if prefix else ""
        parameters, buffers = own_tensors(owner)
        tensors.update({dot + k: p for k, p in parameters.items()})
        tensors.update({dot + k: b for k, b in buffers.items()})
    return tensors


def dtensor_rows(tensor, world: int, rank: int) -> slice | None:
    """The rows of ``tensor``'s full shape that ``rank`` holds under FSDP2's ``Shard(0)`` on a 1-D mesh of every rank,
    in rank order (``torch.chunk``'s split, which FSDP2 shards by); None for any other placement."""
    from torch.distributed.tensor import Shard

    if tensor.ndim == 0 or tuple(tensor.placements) != (Shard(0),) or _mesh_ranks(tensor.device_mesh) != tuple(
            range(world)):
        return None
    rows = tensor.shape[0]
    chunk = -(-rows // world)
    start = min(rows, rank * chunk)
    return slice(start, min(rows, start + chunk))


@functools.lru_cache(maxsize=16)
def _mesh_ranks(mesh) -> tuple[int, ...] | None:
    """The ranks of a 1-D device mesh, in order (None for any other mesh); kept, since ``DeviceMesh.mesh`` rebuilds
    its tensor at every call and a save asks for every parameter and every rank."""
    return tuple(mesh.mesh.tolist()) if mesh.ndim == 1 else None


def streamable(param, world: int) -> bool:
    if isinstance(param, LocalCopy):
        return True
    if is_dtensor(param):
        return dtensor_rows(param, world, 0) is not None
    part = getattr(param, "ds_tensor", None)
    return (
        part is not None
        and getattr(part, "final_location", None) is None  # not swapped out to NVMe
        and not hasattr(part, "ds_quant_scale")  # not quantized
        and dist.get_world_size(param.ds_process_group) == world  # parts are numbered by global rank
    )


def local_part(param, world: int) -> tuple[torch.Tensor, Callable[[int], int]]:
    """This rank's part of ``param``, flattened, and how many of its elements each rank holds (padding excluded)."""
    if isinstance(param, LocalCopy):
        return param.part, param.owned.__getitem__
    if is_dtensor(param):
        per_row = math.prod(param.shape[1:])

        def owned(r: int) -> int:
            rows = dtensor_rows(param, world, r)
            return (rows.stop - rows.start) * per_row

        return param.to_local().detach().reshape(-1), owned
    part = param.ds_tensor.data.reshape(-1)
    size = part.numel()
    return part, lambda r: max(0, min(size, param.ds_numel - r * size))  # the last parts carry padding


def local_copy(tensor: torch.Tensor, copy: Callable[[torch.Tensor], torch.Tensor] | None = None
               ) -> "LocalCopy | torch.Tensor | None":
    """What a background save keeps of ``tensor`` when it starts: this rank's part of a partitioned tensor (a
    ``LocalCopy``), or a whole tensor, copied to CPU memory. None for parts that cannot be streamed (NVMe offload,
    quantized partitions, 2-D meshes): such a model is saved in the foreground.

    Args:
        tensor: a live parameter or buffer, possibly ZeRO-3 or FSDP2 sharded.
        copy: ``copy(part)``: the CPU copy of ``part`` (the tensor itself, or this rank's part of it, flattened), with
            its shape (a background save's snapshot, which may complete it later); default: a new CPU tensor now.

    Returns:
        The copy, or None.
    """
    owned = None
    if is_partitioned(tensor):
        world = dist.get_world_size()
        if not streamable(tensor, world):
            return None
        part, owned_by = local_part(tensor, world)
        owned = [owned_by(r) for r in range(world)]
    else:
        part = tensor.detach()
    copied = copy(part) if copy is not None else part.to("cpu", copy=True)
    return copied if owned is None else LocalCopy(copied, owned, full_shape(tensor))


@contextlib.contextmanager
def gathered(tensors: list[torch.Tensor]):
    """Whole ZeRO-3 parameters among ``tensors`` inside the block, on every rank (call it on every rank)."""
    params = [t for t in tensors if is_zero3(t)]
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


class FsdpUnits:
    """FSDP2's units of a model (the modules ``fully_shard`` was applied to) and the modules each one owns.

    ``unsharded(module)`` makes the parameters of the unit that owns ``module`` whole, as FSDP2 does for a forward
    pass (``FSDPModule.unshard``), so code that reads a module's parameters (PEFT's ``get_delta_weight``,
    ``state_dict``) sees plain tensors. Memory: one unit (a decoder layer; the root's own embeddings, norm and head).
    Call it on every rank, in the same order: unsharding is a collective.
    """

    def __init__(self, model: torch.nn.Module):
        from torch.distributed.fsdp import FSDPModule

        self._owner: dict[int, torch.nn.Module] = {}
        for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
            stack = [unit]
            while stack:  # the unit's modules, down to (not into) the units nested in it
                module = stack.pop()
                self._owner[id(module)] = unit
                stack.extend(c for c in module.children() if not isinstance(c, FSDPModule))

    @contextlib.contextmanager
    def unsharded(self, module: torch.nn.Module, subtree: bool = False):
        """Inside the block, ``module``'s own parameters (with ``subtree``, all of its parameters, including those of
        units nested in it) are whole, plain tensors. Read them with ``module_tensors``, not ``state_dict``."""
        from torch.distributed.fsdp import FSDPModule

        tensors = module.parameters() if subtree else module.parameters(recurse=False)
        if not any(is_dtensor(p) for p in tensors):
            yield
            return
        units = [self._owner[id(module)]] if id(module) in self._owner else []
        if subtree:
            units += [m for m in module.modules() if isinstance(m, FSDPModule) and all(m is not u for u in units)]
        for unit in units:
            unit.unshard()
        try:
            yield
        finally:
            for unit in reversed(units):
                unit.reshard()


def own_tensors(module) -> tuple[dict, dict]:
    """A module's own parameters and persistent buffers (by name, None entries left out), read without its
    state-dict hooks (patch ``module-own-tensors``); where the release moved them, ``named_parameters`` and
    ``named_buffers`` with every buffer taken as persistent.

    Returns:
        ``(parameters, buffers)``.
    """
    if not patches.applies("module-own-tensors"):
        return (dict(module.named_parameters(recurse=False, remove_duplicate=False)),
                dict(module.named_buffers(recurse=False, remove_duplicate=False)))
    return ({k: p for k, p in module._parameters.items() if p is not None},
            {k: b for k, b in module._buffers.items() if b is not None and k not in module._non_persistent_buffers_set})
