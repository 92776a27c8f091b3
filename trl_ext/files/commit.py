"""Committing saved files into place: a partial directory renamed to its target only once everything is written.

``commit`` puts a verified save where ``from_pretrained`` looks (one rename, or file by file into a directory that
holds other things, entry point last); ``replace_dir`` swaps a re-saved ``checkpoint-N``. A crash at any point leaves
either the previous contents or the new ones, never a directory that looks complete but is not. Partial directories
carry ``PARTIAL_SUFFIX`` and start with a dot: ``get_last_checkpoint`` and ``resume_from_checkpoint=True`` never
pick them.
"""

import contextlib
import os
import re
import shutil
from pathlib import Path

PARTIAL_SUFFIX = ".trl_ext-partial"  # partial directories; never matched by checkpoint-N detection
PREVIOUS_SUFFIX = ".trl_ext-previous"  # a replaced checkpoint, removed once the new one is in place
# Files from_pretrained opens first: moved into place last, so an interrupted commit never looks complete.
ENTRY_POINTS = ("model.safetensors.index.json", "model.safetensors", "adapter_model.safetensors")
_WEIGHTS_FILE = re.compile(
    r"^(model|pytorch_model|adapter_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?$")


def fsync(path: str | os.PathLike) -> None:
    """A file (its contents) or a directory (its entries: a rename into it) on disk.

    Args:
        path: the file or directory.

    Raises:
        OSError: it cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse to sync a directory; the rename stands anyway
        fsync(path)


def sync_files(directory: Path) -> None:
    """Every file under ``directory`` on disk (fsync), before the directory is committed: a crash after the rename
    must not leave a complete-looking directory of unwritten files. For files written by another library's writer
    (``save_pretrained``); trl_ext's own writer syncs its files as it closes them.

    Args:
        directory: the partial directory.
    """
    for path in sorted(Path(directory).rglob("*")):
        if path.is_file():
            fsync(path)
    _fsync_dir(Path(directory))


def commit(partial: Path, target: Path) -> None:
    """Move a fully written and verified ``partial`` directory to ``target``.

    A missing target is replaced by one atomic rename. A directory that already exists (an output_dir with
    checkpoint-N folders, say, or a checkpoint-N other ranks write into) receives the files one rename each: the
    previous model's files are first moved aside into ``.trl_ext-previous``, and the entry point (index or weights
    file) comes last, so an interruption never leaves a directory that looks complete but mixes two saves.
    """
    # An existing target, even an empty one, stays in place: another rank may be writing its own files into it (its
    # RNG state in a checkpoint-N this rank created), and removing it for one rename would pull the directory from
    # under that write.
    if not target.exists():
        partial.rename(target)
        _fsync_dir(target.parent)
        return
    aside = target / PREVIOUS_SUFFIX
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir()
    new = sorted(os.listdir(partial))
    for name in os.listdir(target):
        if name != aside.name and (name in new or _WEIGHTS_FILE.match(name)):
            (target / name).rename(aside / name)
    for name in sorted(new, key=lambda n: n in ENTRY_POINTS):
        (partial / name).rename(target / name)
    _fsync_dir(target)
    partial.rmdir()
    shutil.rmtree(aside, ignore_errors=True)


def replace_dir(partial: Path, target: Path) -> None:
    """Put directory ``partial`` at ``target``, replacing an existing directory there (a re-saved checkpoint-N)."""
    aside = target.with_name(f".{target.name}{PREVIOUS_SUFFIX}")
    shutil.rmtree(aside, ignore_errors=True)
    if target.exists():
        target.rename(aside)
    partial.rename(target)
    _fsync_dir(target.parent)
    shutil.rmtree(aside, ignore_errors=True)
