"""Every rank's part of each tensor to the rank that writes it, in chunks, with bounded memory.

``stream`` sends each ZeRO-3 partition or FSDP2 row block (``engines.sharded``) to the writing rank in chunks, in rank
order, so the writing rank never holds more than one chunk of a parameter, whatever its size; with one copy per
node, each node's writer of a file needs every tensor of it, so each tensor is all-gathered whole from the parts.
Parts that cannot be streamed are gathered whole, one module (ZeRO-3) or one tensor (FSDP2) at a time.

A background save streams ``LocalCopy``s instead of live parameters: each rank's own part copied to CPU memory when
the save starts (``engines.sharded.local_copy``), sent over a process group of its own while training goes on.
"""

from typing import Protocol

import torch
import torch.distributed as dist

from trl_ext.engines.sharded import (  # gathered: also imported from here by recipes/grpo.py
    full_shape,
    gathered,
    is_dtensor,
    is_partitioned,
    local_part,
    streamable,
)

CHUNK_BYTES = 16 * 2**20  # per message; the writing rank holds at most one of these per rank it receives from


class Sink(Protocol):
    def begin(self, name: str): ...
    def append(self, piece: torch.Tensor) -> None: ...
    def end(self) -> None: ...


def _comm_device(group=None) -> torch.device:
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _stream_partitions(param, sink: Sink | None, writer_rank: int, device: torch.device, group=None) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    part, owned_by = local_part(param, world)
    chunk = max(1, CHUNK_BYTES // part.element_size())
    for r in range(world):
        owned = owned_by(r)
        for start in range(0, owned, chunk):
            n = min(chunk, owned - start)
            if r == writer_rank:
                if sink is not None:
                    sink.append(part[start : start + n])
            elif rank == r:
                dist.send(part[start : start + n].to(device), dst=writer_rank, group=group)
            elif rank == writer_rank:
                received = torch.empty(n, dtype=part.dtype, device=device)
                dist.recv(received, src=r, group=group)
                if sink is not None:
                    sink.append(received)


def _all_gather_whole(param, device: torch.device, group=None) -> torch.Tensor:
    """``param``'s full contents on every rank, from every rank's part with one all-gather (for one replica of the
    checkpoint per node, where each node's writer needs every tensor of its files). Built from the parts, not with
    DeepSpeed's ``GatheredParameters``, which on DeepSpeed 0.19.2 can hand back an unfilled buffer for a parameter
    whose prefetch is in flight."""
    world = dist.get_world_size()
    part, owned_by = local_part(param, world)
    owned = [owned_by(r) for r in range(world)]
    size = max(part.numel(), *owned)  # ZeRO-3 parts are equal (padded); FSDP2's last rows may be fewer
    padded = torch.zeros(size, dtype=part.dtype, device=device)
    padded[: part.numel()] = part
    parts = [torch.empty(size, dtype=part.dtype, device=device) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, owned)]).view(full_shape(param)).cpu()


def _write_whole(named, sink: Sink | None) -> None:
    if sink is not None:
        for name, tensor in named:
            sink.begin(name)
            sink.append(tensor)
            sink.end()


def stream(named: list[tuple[str, torch.Tensor]], sink: Sink | None, collective: bool, writer_rank: int | None,
           group=None) -> None:
    """Feed each tensor's full contents to ``sink``, in order: ``begin(name)``, ``append(piece)``..., ``end()``.

    Call on every rank. ``sink``: None on ranks that do not write. ``collective``: the model is ZeRO-3 partitioned,
    so every rank takes part. ``writer_rank``: the one writing rank, or None when several ranks write the same file
    (one replica per node: every rank then receives each whole tensor). ``group``: the process group of the transfers
    (default: the default one).
    """
    if not collective:
        _write_whole(named, sink)
        return
    world = dist.get_world_size()
    device = _comm_device(group)
    with torch.no_grad():
        batch: list[tuple[str, torch.Tensor]] = []  # consecutive tensors of one module to gather whole
        for item in [*named, None]:
            if item is not None and is_partitioned(item[1]) and streamable(item[1], world):
                _gather_and_write(batch, sink)
                batch = []
                name, param = item
                if sink is not None:
                    sink.begin(name)
                if writer_rank is None:
                    whole = _all_gather_whole(param, device, group)
                    if sink is not None:
                        sink.append(whole.reshape(-1))
                else:
                    _stream_partitions(param, sink, writer_rank, device, group)
                if sink is not None:
                    sink.end()
                continue
            if batch and (item is None or item[0].rpartition(".")[0] != batch[0][0].rpartition(".")[0]):
                _gather_and_write(batch, sink)
                batch = []
            if item is not None:
                batch.append(item)


def _gather_and_write(group: list[tuple[str, torch.Tensor]], sink: Sink | None) -> None:
    if not group:
        return
    if any(is_dtensor(t) for _, t in group):  # a collective per tensor; only the writers keep the result
        for name, tensor in group:
            _write_whole([(name, tensor.full_tensor() if is_dtensor(tensor) else tensor)], sink)
        return
    with gathered([t for _, t in group]):
        _write_whole(group, sink)
