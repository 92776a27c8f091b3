"""Committing saved files into place: a staging directory renamed to its target only once everything is written.

``commit`` puts a verified save where ``from_pretrained`` looks (one rename, or file by file into a directory that
holds other things, entry point last); ``replace_dir`` swaps a re-saved ``checkpoint-N``; ``StagedCheckpoint`` runs
a whole Trainer checkpoint (weights, optimizer, RNG and trainer states) in a hidden directory. A crash at any point
leaves either the previous contents or the new ones, never a directory that looks complete but is not.
"""

import contextlib
import os
import re
import shutil
from pathlib import Path

PARTIAL_SUFFIX = ".trl_ext-partial"  # staging directories; never matched by checkpoint-N detection
PREVIOUS_SUFFIX = ".trl_ext-previous"  # a replaced checkpoint, removed once the new one is in place
# Files from_pretrained opens first: moved into place last, so an interrupted commit never looks complete.
ENTRY_POINTS = ("model.safetensors.index.json", "model.safetensors", "adapter_model.safetensors")
_WEIGHTS_FILE = re.compile(
    r"^(model|pytorch_model|adapter_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?$")


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def commit(staging: Path, target: Path) -> None:
    """Move a fully written and verified ``staging`` directory to ``target``.

    A missing or empty target is replaced by one atomic rename. A directory that already holds other things (an
    output_dir with checkpoint-N folders, say) receives the files one rename each: the previous model's files are
    first moved aside into ``.trl_ext-previous``, and the entry point (index or weights file) comes last, so an
    interruption never leaves a directory that looks complete but mixes two saves.
    """
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()
    if not target.exists():
        staging.rename(target)
        _fsync_dir(target.parent)
        return
    aside = target / PREVIOUS_SUFFIX
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir()
    new = sorted(os.listdir(staging))
    for name in os.listdir(target):
        if name != aside.name and (name in new or _WEIGHTS_FILE.match(name)):
            (target / name).rename(aside / name)
    for name in sorted(new, key=lambda n: n in ENTRY_POINTS):
        (staging / name).rename(target / name)
    _fsync_dir(target)
    staging.rmdir()
    shutil.rmtree(aside, ignore_errors=True)


def replace_dir(staging: Path, target: Path) -> None:
    """Put directory ``staging`` at ``target``, replacing an existing directory there (a re-saved checkpoint-N)."""
    aside = target.with_name(f".{target.name}{PREVIOUS_SUFFIX}")
    shutil.rmtree(aside, ignore_errors=True)
    if target.exists():
        target.rename(aside)
    staging.rename(target)
    _fsync_dir(target.parent)
    shutil.rmtree(aside, ignore_errors=True)


class StagedCheckpoint:
    """Runs a Trainer checkpoint save into a hidden directory and renames it to ``checkpoint-N`` only when complete.

    Everything the Trainer writes (weights, optimizer and scheduler, RNG states of every rank, trainer state) lands in
    ``<run_dir>/.checkpoint-N.trl_ext-partial/checkpoint-N`` first. A crash or kill mid-save leaves only that hidden
    directory, which ``get_last_checkpoint`` and ``resume_from_checkpoint=True`` never pick.
    """

    def __init__(self, run_dir: str, name: str, is_writer: bool, barrier, release=None):
        self.run_dir, self.name, self.is_writer, self.barrier = Path(run_dir), name, is_writer, barrier
        self.release = release  # a background save: called with the rename (writer) or None, instead of renaming
        self.staging_run_dir = self.run_dir / f".{name}{PARTIAL_SUFFIX}"
        self.final = self.run_dir / name

    def __enter__(self) -> "StagedCheckpoint":
        if self.is_writer:
            for stale in self.run_dir.glob(f".checkpoint-*{PARTIAL_SUFFIX}"):  # from interrupted saves
                shutil.rmtree(stale, ignore_errors=True)
            self.staging_run_dir.mkdir(parents=True)
        self.barrier()
        return self

    def staged_path(self, path: str | None) -> bool:
        return bool(path) and Path(path).absolute().is_relative_to(self.staging_run_dir.absolute())

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            return  # the staging directory stays hidden; the next save removes it
        self.barrier()  # every rank has written its files (RNG state, optimizer shards)
        if self.release is not None:  # renamed once the weights, still being written, are committed into it
            self.release(self.put_in_place if self.is_writer else None)
            return
        if self.is_writer:
            self.put_in_place()
        self.barrier()

    def put_in_place(self) -> None:
        """The writer: the complete checkpoint renamed to ``checkpoint-N``."""
        replace_dir(self.staging_run_dir / self.name, self.final)
        self.staging_run_dir.rmdir()
