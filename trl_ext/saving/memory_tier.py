"""The memory tier: a checkpoint every ``memory_checkpoint_steps`` steps, kept in this machine's memory rather than the
output directory, so that a run whose processes are restarted resumes from a few steps ago instead of the last disk
checkpoint (which a large model writes every 30-60 minutes).

Where: ``<TRL_EXT_MEMORY_DIR>/<key>/checkpoint-N`` (``TRL_EXT_MEMORY_DIR`` defaults to ``/dev/shm/trl_ext``, node-local
shared memory, which outlives the ranks that wrote it), ``<key>`` made from the output directory's path. What: the
same files as the disk's ``checkpoint-N``, written by the same code (``Checkpoints.take``), always in the background
(the copy stage of background checkpoints), so resuming is shared. Kept: the newest committed one (and the one being
written); a manifest of every file's size and checksum beside each (``.checkpoint-N.manifest.json``), written once
the checkpoint is committed: a checkpoint without its manifest, or whose files no longer match it, is never resumed.

A note in the tier's directory names the output directory and a token kept in it (``.trl_ext-memory``), so that a
memory checkpoint is resumed only into the output directory it was taken for, not a new one made at the same path. A run
that does not resume from the tier clears it when training starts; a run that completes clears it at the end.

This is one machine's tier: on several machines it stays off (its replication to a peer machine is not built yet).
"""

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from trl_ext.files import checkpoint_dirs, manifest
from trl_ext.settings import environment
from trl_ext.settings.trainer_options import SaveOptions

NOTE = "output_dir.json"  # in the tier's directory: the output directory it belongs to
TOKEN = ".trl_ext-memory"  # in the output directory: the token its memory tier's note holds


def manifest_path(checkpoint: Path) -> Path:
    """Where the manifest of a memory ``checkpoint-N`` is kept: beside it, hidden (rotation never sees it)."""
    return checkpoint.parent / f".{checkpoint.name}.manifest.json"


def _token(output_dir: str) -> str | None:
    try:
        return (Path(output_dir) / TOKEN).read_text().strip() or None
    except OSError:
        return None


@dataclass
class MemoryTier:
    """One run's memory checkpoints on this machine.

    Args:
        root: the tier's directory for this output directory.
        steps: a memory checkpoint every this many steps.
        output_dir: the run's output directory (absolute).
    """

    root: Path
    steps: int
    output_dir: str
    why_off: str | None = None  # set once the tier is off for this run, and why

    @classmethod
    def of(cls, args) -> "MemoryTier | None":
        """The tier a training config asks for (``memory_checkpoint_steps``), or None when it asks for none.

        Args:
            args: the training config.

        Returns:
            The tier, under ``TRL_EXT_MEMORY_DIR``.
        """
        steps = SaveOptions.of(args).memory_checkpoint_steps
        if not steps:
            return None
        output_dir = os.path.abspath(args.output_dir)
        key = hashlib.sha256(output_dir.encode()).hexdigest()[:16]
        return cls(Path(environment.MEMORY_DIR.text()) / key, steps, output_dir)

    @property
    def on(self) -> bool:
        return self.why_off is None

    def turn_off(self, why: str) -> str:
        """The tier off for this run; returns the one line that says so."""
        self.why_off = why
        return (f"memory_checkpoint_steps={self.steps}: no checkpoints in memory, because {why}; disk checkpoints go "
                "on as set.")

    def due(self, state, control, taken_step: int) -> bool:
        """Whether a memory checkpoint is due at this step boundary: every ``steps`` steps, but not where a disk
        checkpoint was just taken (``taken_step``) or training is about to stop (the final save follows)."""
        step = state.global_step
        return (self.on and step > 0 and step % self.steps == 0 and step != taken_step
                and not control.should_training_stop and step < state.max_steps)

    # What a resume reads

    def belongs_here(self) -> bool:
        """Whether the tier's checkpoints were taken for this output directory, as it is now (not one deleted and
        made again at the same path)."""
        try:
            note = json.loads((self.root / NOTE).read_text())
        except (OSError, ValueError):
            return False
        token = _token(self.output_dir)
        return note.get("output_dir") == self.output_dir and token is not None and note.get("token") == token

    def newest(self) -> tuple[str | None, str | None]:
        """The newest committed memory checkpoint that is whole, and why a newer one was passed over.

        Returns:
            ``(path or None, line or None)``: the line names a checkpoint that was not whole (files that differ from
            its manifest, or no manifest) and is not resumed.
        """
        if not self.root.is_dir() or not self.belongs_here():
            return None, None
        skipped = None
        for path in reversed(checkpoint_dirs.committed(self.root).values()):
            why = self._damage(path)
            if why is None:
                return str(path), skipped
            skipped = skipped or f"memory checkpoint {path} is not resumed: {why}"
        return None, skipped

    @staticmethod
    def _damage(path: Path) -> str | None:
        try:
            expected = manifest.Manifest.from_json(manifest_path(path).read_text())
        except (OSError, ValueError) as exc:
            return f"its manifest cannot be read ({type(exc).__name__}), so it may be incomplete"
        return manifest.directory_mismatch(path, expected)

    # What training writes (this machine's first process)

    def begin(self, resumed: str | None) -> None:
        """When training starts: the tier's directory made this output directory's; every memory checkpoint but
        ``resumed`` (the one this run resumes, kept until a newer one is committed) removed."""
        keep = Path(resumed) if resumed else None
        if self.root.is_dir():
            for entry in self.root.iterdir():
                if entry != keep and (keep is None or entry != manifest_path(keep)):
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        self.root.mkdir(parents=True, exist_ok=True)
        token = _token(self.output_dir)
        if token is None:
            os.makedirs(self.output_dir, exist_ok=True)
            token = uuid.uuid4().hex
            (Path(self.output_dir) / TOKEN).write_text(token)
        note = {"output_dir": self.output_dir, "token": token}
        tmp = self.root / f".{NOTE}.{os.getpid()}"
        tmp.write_text(json.dumps(note))
        os.replace(tmp, self.root / NOTE)

    def committed(self, checkpoint: Path, step: int) -> None:
        """Once a memory checkpoint is in place: its manifest written beside it, then older ones removed."""
        made = manifest.of_directory(checkpoint, step=step)
        tmp = checkpoint.parent / f".{checkpoint.name}.manifest.tmp"
        tmp.write_text(made.to_json())
        os.replace(tmp, manifest_path(checkpoint))
        for older, path in checkpoint_dirs.committed(self.root).items():
            if older < step:
                manifest_path(path).unlink(missing_ok=True)  # first: a checkpoint without it is never resumed
                shutil.rmtree(path, ignore_errors=True)

    def clear(self) -> None:
        """Training completed: the tier's memory given back."""
        shutil.rmtree(self.root, ignore_errors=True)

    def room(self, need: int) -> str | None:
        """Whether this machine can hold the tier: ``need`` bytes per checkpoint (its processes added up), two of them
        while one is written, in the tier's file system and in available memory beside the copies' buffers.

        Args:
            need: the bytes one checkpoint's files take on this machine (what the copies measured).

        Returns:
            Why it cannot (one clause), or None.
        """
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.root).free + _bytes_under(self.root)
        except OSError as exc:
            return f"{self.root} cannot be written ({exc.strerror or exc})"
        if free < 2 * need:
            return (f"two checkpoints ({2 * need / 2**30:.2f} GiB) do not fit in {self.root.parent}, which has "
                    f"{free / 2**30:.2f} GiB free (set TRL_EXT_MEMORY_DIR elsewhere, or give /dev/shm more room)")
        available = psutil.virtual_memory().available + _bytes_under(self.root)
        if available < 2 * need:
            return (f"two checkpoints ({2 * need / 2**30:.2f} GiB) do not fit in this machine's available memory "
                    f"({available / 2**30:.2f} GiB)")
        return None


def _bytes_under(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0
