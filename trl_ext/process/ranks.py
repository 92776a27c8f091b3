"""This process's place in the launch: its rank and the number of processes as the launcher set them (readable
before any process group), and whether it runs in a process group."""

import os


def env_rank() -> int:
    """This process's global rank as the launcher set it (0 outside a launch); readable before any process group."""
    return int(os.environ.get("RANK", "0"))


def env_world_size() -> int:
    """The number of processes the launcher started (1 outside a launch)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def distributed() -> bool:
    """Whether this process runs in a default process group (a multi-process launch, once it exists)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
