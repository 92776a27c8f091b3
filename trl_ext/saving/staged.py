"""A whole Trainer checkpoint (weights, optimizer and scheduler, RNG states, trainer state) written in a hidden
directory and renamed to ``checkpoint-N`` only once complete."""

import shutil
from pathlib import Path

from trl_ext.files.commit import PARTIAL_SUFFIX, replace_dir


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
