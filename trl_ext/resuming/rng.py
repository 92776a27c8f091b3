"""Each rank's RNG state on resume: on another number of processes, rank ``r`` takes rank ``r``'s saved state, and a
rank that did not exist is seeded from (seed, step, rank), so that repeating the resume repeats the run."""

import contextlib
import os
import tempfile
from pathlib import Path

from trl_ext.resuming.world_size import Reshard


@contextlib.contextmanager
def rng_checkpoint(checkpoint: str, reshard: Reshard, process_index: int):
    """A directory where the Trainer finds this rank's RNG state under the name it expects for the new world size.

    Rank ``r`` takes the state saved by rank ``r``. A rank that did not exist yields None: the caller seeds it.

    Args:
        checkpoint: the ``checkpoint-N`` directory.
        reshard: from ``world_size.read_reshard``.
        process_index: this process's global rank.

    Returns:
        (context manager) the directory to give ``Trainer._load_rng_state``, or None.
    """
    saved = "rng_state.pth" if reshard.saved_world_size == 1 else f"rng_state_{process_index}.pth"
    wanted = "rng_state.pth" if reshard.world_size == 1 else f"rng_state_{process_index}.pth"
    source = Path(checkpoint) / saved
    if process_index >= reshard.saved_world_size or not source.is_file():
        yield None
        return
    with tempfile.TemporaryDirectory() as tmp:
        os.symlink(source.resolve(), Path(tmp) / wanted)
        yield tmp


def seed_for_new_rank(seed: int, step: int, reshard: Reshard, process_index: int) -> int:
    """The seed of a rank the checkpoint has no RNG state for: the same on every repeat of this resume."""
    return seed + step * reshard.world_size + process_index
