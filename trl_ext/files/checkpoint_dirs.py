"""An output directory's ``checkpoint-N`` folders: their one name pattern (transformers' ``PREFIX_CHECKPOINT_DIR``),
and the committed ones listed. A checkpoint being written lives in a hidden partial directory
(``.checkpoint-N.trl_ext-partial``) until it is complete and checked, so only committed ones match. Nothing here
imports torch or transformers: the Slurm batch script and the mirror read it too."""

import os
import re
from pathlib import Path

PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
PATTERN = re.compile(rf"^{PREFIX}-(\d+)$")


def name(step: int) -> str:
    """The folder name of the checkpoint of ``step``: ``checkpoint-<step>``."""
    return f"{PREFIX}-{step}"


def step_of(folder: str | os.PathLike) -> int | None:
    """The step of a ``checkpoint-N`` folder (its last path part), or None for any other name.

    Args:
        folder: a folder's name or path (local, or a path in a store).

    Returns:
        N, or None.
    """
    match = PATTERN.match(Path(str(folder).rstrip("/")).name)
    return int(match.group(1)) if match else None


def committed(directory: str | os.PathLike) -> dict[int, Path]:
    """The committed ``checkpoint-N`` folders of ``directory``, by step, oldest first (none when it does not exist).

    Args:
        directory: a run's output directory.

    Returns:
        ``{step: path}``.
    """
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return {}
    found = {step: Path(entry.path) for entry in entries
             if (step := step_of(entry.name)) is not None and entry.is_dir()}
    return dict(sorted(found.items()))


def newest_step(directory: str | os.PathLike) -> int:
    """The step of the newest committed checkpoint of ``directory`` (0 when there is none)."""
    return max(committed(directory), default=0)
