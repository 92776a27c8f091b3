"""This process as the launcher started it: its rank and the world size (readable before any process group), and
the one-line notices trl_ext prints."""

import logging
import os

logger = logging.getLogger("trl_ext")


def env_rank() -> int:
    """This process's global rank as the launcher set it (0 outside a launch); readable before any process group."""
    return int(os.environ.get("RANK", "0"))


def env_world_size() -> int:
    """The number of processes the launcher started (1 outside a launch)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def notice(message: str) -> None:
    """One-line notice, printed once per process (rank 0 only when distributed)."""
    if env_rank() == 0:
        logger.warning(f"[trl_ext] {message}")
