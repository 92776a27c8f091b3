"""This process's place in the launch: its rank and the number of processes, from torch.distributed once its process
group is up, and before that as its launcher set them; whether it runs in a process group.

Before the group, the launcher's variables are read by ``placement.orchestrators``, the one reader of every launcher's
variables, which sits above this room: the package's root hands its readers down (``launched_by``) before anything
else of trl_ext runs."""

import sys
from collections.abc import Callable

_launched: list[Callable[[], int]] = [lambda: 0, lambda: 1]  # the launcher's rank and world size (set by trl_ext/)


def launched_by(rank: Callable[[], int], world_size: Callable[[], int]) -> None:
    """Where the rank and world size come from before a process group exists.

    Args:
        rank: this process's global rank as its launcher set it (0 outside a launch).
        world_size: the number of processes its launcher started (1 outside a launch).
    """
    _launched[:] = [rank, world_size]


def _group():
    """torch.distributed when its default group is up (never imported here: a process that has not imported torch
    has no group)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def env_rank() -> int:
    """This process's global rank (0 outside a launch); readable before any process group."""
    group = _group()
    return group.get_rank() if group is not None else _launched[0]()


def env_world_size() -> int:
    """The number of processes the launcher started (1 outside a launch)."""
    group = _group()
    return group.get_world_size() if group is not None else _launched[1]()


def distributed() -> bool:
    """Whether this process runs in a default process group (a multi-process launch, once it exists)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
