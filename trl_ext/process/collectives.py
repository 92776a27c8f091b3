"""Every rank-wide decision, on every rank: rank 0 decides for all (``decided_on_rank0``), every rank's view
(``from_every_rank``), the largest of every rank's number (``max_over_ranks``). An error agreed on every rank is
``errors.agree``. Each is a collective when distributed, and the value itself otherwise."""

from trl_ext.process.ranks import distributed


def decided_on_rank0(decide, group=None):
    """``decide()`` run on rank 0 only, its answer (any picklable object) returned on every rank: for what reads the
    disk, a store or the environment, where ranks could see different things (a file being written, a clock). What it
    raises is raised on every rank, never leaving a rank waiting. A collective when distributed; ``decide()`` alone
    otherwise.

    Args:
        decide: computes the answer; called on rank 0 only.
        group: the process group (default: the default one).

    Returns:
        Rank 0's answer, on every rank.
    """
    if not distributed():
        return decide()
    import torch.distributed as dist

    answer = [None, None]
    if dist.get_rank() == 0:
        try:
            answer = [decide(), None]
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - raised on every rank below (a refusal of bad input too)
            answer = [None, exc]
    dist.broadcast_object_list(answer, src=0, group=group)
    if answer[1] is not None:
        raise answer[1]
    return answer[0]


def from_every_rank(value, group=None) -> list:
    """Every rank's ``value`` (any picklable object), in rank order, on every rank: for what each rank sees on its own
    (a file on its node's disk). A collective when distributed; ``[value]`` otherwise.

    Args:
        value: this rank's value.
        group: the process group (default: the default one).

    Returns:
        The values of all ranks.
    """
    if not distributed():
        return [value]
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def max_over_ranks(values, device=None, group=None):
    """The largest of every rank's number (or of each of a list of numbers), on every rank: one all-reduce, cheap
    enough for every step boundary (a signal that reached only some ranks, the slowest rank's part of a checkpoint).
    ``values`` themselves outside a distributed run.

    Args:
        values: this rank's number, or a list of numbers.
        device: where the collective's tensor lives (default: the backend's, the current CUDA device under NCCL, else
            the CPU).
        group: the process group (default: the default one).

    Returns:
        The maximum over ranks, in the shape given (ints stay ints).
    """
    if not distributed():
        return values
    import torch
    import torch.distributed as dist

    numbers = list(values) if isinstance(values, (list, tuple)) else [values]
    if device is None and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    reduced = torch.tensor([float(v) for v in numbers], dtype=torch.float64, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    out = [type(v)(r) for v, r in zip(numbers, reduced.tolist(), strict=True)]
    return out if isinstance(values, (list, tuple)) else out[0]
