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

On several machines each checkpoint is also replicated to the next machine before it counts, and a resume first
gathers, on every machine, the parts it lacks (``memory_replicas``).
"""

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from trl_ext.files import checkpoint_dirs, manifest
from trl_ext.process import memory_limit
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
    machines: object = None  # memory_replicas.Machines, once known (collective)
    agreed: object = field(default=None, repr=False)  # memory_replicas.Agreed: on several machines, what is resumed
    token: str | None = None  # the output directory's token as rank 0 read it (share_token)

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
        token = self.token or _token(self.output_dir)
        return note.get("output_dir") == self.output_dir and token is not None and note.get("token") == token

    def share_token(self, args, create: bool) -> None:
        """The output directory's token as rank 0 reads it (made there first with ``create``), kept on every rank
        (``token``): every machine's note names the same one, even where the output directory is not shared. Collective
        when distributed."""
        from trl_ext.process.collectives import decided_on_rank0

        def read() -> str | None:
            token = _token(self.output_dir)
            if token is None and create:
                os.makedirs(self.output_dir, exist_ok=True)
                token = uuid.uuid4().hex
                tmp = Path(self.output_dir) / f"{TOKEN}.{os.getpid()}"
                tmp.write_text(token)
                os.replace(tmp, Path(self.output_dir) / TOKEN)
            return token

        self.token = decided_on_rank0(read)

    def know_machines(self, args) -> None:
        """The run's machines (``memory_replicas.Machines``), found once; collective when distributed."""
        if self.machines is None:
            from trl_ext.saving.memory_replicas import Machines

            self.machines = Machines.of(args)

    @property
    def replicated(self) -> bool:
        """Whether this run's memory checkpoints are replicated to a peer machine (it runs on several)."""
        return self.machines is not None and self.machines.count > 1

    def newest(self) -> tuple[str | None, str | None]:
        """The newest committed memory checkpoint that is whole, and why a newer one was passed over. On several
        machines, the one they agreed on (``memory_replicas.settle``), or none.

        Returns:
            ``(path or None, line or None)``: the line names a checkpoint that was not whole (files that differ from
            its manifest, or no manifest) and is not resumed.
        """
        if self.agreed is not None:
            step = self.agreed.step
            return (str(Path(self.agreed.root) / checkpoint_dirs.name(step)) if step else None), self.agreed.skipped
        if self.replicated:  # one machine's memory alone is not the run's
            return None, None
        if not self.root.is_dir() or not self.belongs_here():
            return None, None
        skipped = None
        for path in reversed(checkpoint_dirs.committed(self.root).values()):
            why = self._damage(path) or _lacks_parts(path)
            if why is None:
                return str(path), skipped
            skipped = skipped or f"memory checkpoint {path} is not resumed: {why}"
        return None, skipped

    def newest_step(self) -> int:
        """The step of this machine's newest committed memory checkpoint of this output directory (0: none), as the
        count of failed attempts reads progress (``placement.failure_limit``): before anything loads, on the process
        that decides."""
        if not self.root.is_dir() or not self.belongs_here():
            return 0
        return max((step for step, path in checkpoint_dirs.committed(self.root).items()
                    if manifest_path(path).is_file()), default=0)

    def here(self, path: str | None) -> str | None:
        """``path`` as this machine holds it: the agreed memory checkpoint that rank 0 named is this machine's own
        copy of it (each machine resumes from its own memory); any other path as it is."""
        agreed = self.agreed
        if path and agreed is not None and agreed.step and \
                path == str(Path(agreed.root) / checkpoint_dirs.name(agreed.step)):
            return str(self.root / checkpoint_dirs.name(agreed.step))
        return path

    def whole(self) -> dict[int, dict]:
        """This machine's whole memory checkpoints of this output directory: step -> its parts note
        (``memory_replicas.read_holds``); read where they are kept (each machine's first process)."""
        from trl_ext.saving.memory_replicas import read_holds

        if not self.root.is_dir() or not self.belongs_here():
            return {}
        found = {}
        for step, path in checkpoint_dirs.committed(self.root).items():
            notes = read_holds(path)
            if notes is not None and self._damage(path) is None:
                found[step] = notes
        return found

    @staticmethod
    def _damage(path: Path) -> str | None:
        try:
            expected = manifest.Manifest.from_json(manifest_path(path).read_text())
        except (OSError, ValueError) as exc:
            return f"its manifest cannot be read ({type(exc).__name__}), so it may be incomplete"
        return manifest.directory_mismatch(path, expected)

    # What training writes (this machine's first process)

    def begin(self, resumed: str | None) -> None:
        """When training starts (``share_token`` first): the tier's directory made this output directory's; every
        memory checkpoint but ``resumed`` (the one this run resumes, kept until a newer one is committed) removed."""
        keep = Path(resumed) if resumed else None
        if self.root.is_dir():
            for entry in self.root.iterdir():
                if entry != keep and (keep is None or entry != manifest_path(keep)):
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        self.root.mkdir(parents=True, exist_ok=True)
        note = {"output_dir": self.output_dir, "token": self.token}
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
        limited = memory_limit.room_left()  # a pod's limit: files in a tmpfs count against it
        if limited is not None and limited[0] + _bytes_under(self.root) < 2 * need:
            return (f"two checkpoints ({2 * need / 2**30:.2f} GiB) do not fit under this container's memory limit "
                    f"({limited[0] / 2**30:.2f} GiB left of {limited[1] / 2**30:.2f} GiB; files in /dev/shm count "
                    "against it): give the pod more memory, or set TRL_EXT_MEMORY_DIR elsewhere")
        return None


def _lacks_parts(path: Path) -> str | None:
    """Why a memory checkpoint taken on several machines cannot be resumed from this machine alone: the parts of
    machines it does not hold (a machine holds its own and the previous machine's), or None."""
    from trl_ext.saving.memory_replicas import read_holds

    notes = read_holds(path)
    missing = sorted(set(range(notes["machines"])) - set(notes["parts"])) if notes else []
    if not missing:
        return None
    return (f"it was taken on {notes['machines']} machines and holds the parts of machines "
            f"{', '.join(map(str, sorted(notes['parts'])))} only (machine {missing[0]}'s is elsewhere)")


def _bytes_under(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0
