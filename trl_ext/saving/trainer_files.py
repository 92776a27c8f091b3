"""The directory of a Trainer ``checkpoint-N`` around what saving writes into it: the hidden partial directory it is
written in (``PartialDir``), the fix-ups Trainer's files need there (``fix_trainer_files``), the commit with the
``after_commit`` hooks and retention (``commit_checkpoint``); and TRL's model card, written beside the checkpoints
(``ModelCard``).
"""

import shutil
from collections.abc import Callable
from pathlib import Path

from transformers.trainer_utils import rotate_checkpoints

from trl_ext.files.commit import PARTIAL_SUFFIX, replace_dir
from trl_ext.process.notices import logger


class PartialDir:
    """A whole Trainer checkpoint written in a hidden directory and renamed to ``checkpoint-N`` only once complete.

    Everything the Trainer writes lands in ``<output_dir>/.checkpoint-N.trl_ext-partial/checkpoint-N`` first
    (``path``, the partial directory, is what Trainer is given as its output directory). A crash or kill mid-save
    leaves only that hidden directory, which ``get_last_checkpoint`` and ``resume_from_checkpoint=True`` never pick,
    and which the next checkpoint removes.

    Args:
        output_dir: the run's output directory.
        name: ``checkpoint-N``.
        is_writer: this rank creates, renames and rotates (the others only write their files into it).
    """

    def __init__(self, output_dir: str, name: str, is_writer: bool):
        self.output_dir, self.name, self.is_writer = Path(output_dir), name, is_writer
        self.path = self.output_dir / f".{name}{PARTIAL_SUFFIX}"
        self.final = self.output_dir / name

    @property
    def step(self) -> int:
        """The checkpoint's step (from its name: a background commit lands steps after it was taken)."""
        return int(self.name.rpartition("-")[2])

    def create(self) -> None:
        """The writer: an empty hidden directory, and none left by interrupted checkpoints."""
        if self.is_writer:
            for stale in self.output_dir.glob(f".checkpoint-*{PARTIAL_SUFFIX}"):
                shutil.rmtree(stale, ignore_errors=True)
            self.path.mkdir(parents=True)

    def holds(self, path: str | None) -> bool:
        """Whether ``path`` lies in the hidden directory."""
        return bool(path) and Path(path).absolute().is_relative_to(self.path.absolute())

    def put_in_place(self) -> None:
        """The writer: the complete checkpoint renamed to ``checkpoint-N``."""
        replace_dir(self.path / self.name, self.final)
        self.path.rmdir()


def fix_trainer_files(trainer, partial: PartialDir) -> None:
    """Trainer's files in the partial directory, as they must be once it is renamed into place: DeepSpeed's ``latest``
    tag on each node's replica, and the trainer state's best checkpoint under its final name."""
    written = partial.path / partial.name
    storage = trainer.storage
    if storage and not storage.shared and partial.is_writer and trainer.is_deepspeed_enabled:
        # DeepSpeed writes its ``latest`` tag on global rank 0 only: each node's replica needs its own
        (written / "latest").write_text(f"global_step{trainer.state.global_step}")
    if partial.holds(trainer.state.best_model_checkpoint):  # this checkpoint is the best so far
        trainer.state.best_model_checkpoint = str(partial.final)
        if trainer.args.should_save:
            trainer.state.save_to_json(str(written / "trainer_state.json"))


def commit_checkpoint(trainer, partial: PartialDir, after_commit: list[Callable[[Path, int], None]],
                      rotate: bool = True) -> int:
    """The writer: the checkpoint renamed into place, the ``after_commit`` hooks run (the mirror; a hook's failure is
    said, never undoes the commit), then older checkpoints rotated out (``save_total_limit``). The other ranks: nothing.

    Args:
        trainer: the trainer (its output directory, retention and best checkpoint).
        partial: the checkpoint, complete.
        after_commit: called with the committed directory and its step.
        rotate: rotate by ``save_total_limit`` (a memory checkpoint's hook keeps its own tier instead).

    Returns:
        The committed directory's bytes (0 on the ranks that do not write).
    """
    if not partial.is_writer:
        return 0
    partial.put_in_place()
    committed = directory_bytes(partial.final)
    for hook in after_commit:
        try:
            hook(partial.final, partial.step)
        except Exception as exc:  # noqa: BLE001 - the checkpoint is committed; what follows it is the hook's
            logger.warning(f"[trl_ext] after {partial.final} was committed: {type(exc).__name__}: {exc}")
    if not rotate:
        return committed
    rotate_checkpoints(output_dir=trainer.args.output_dir, save_total_limit=trainer.args.save_total_limit,
                       best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)
    return committed


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class ModelCard:
    """TRL's trainers write the run's model card (``output_dir/README.md``) at every checkpoint, the same each time
    (it held every checkpoint 9-23 ms): at a checkpoint it is written again only when what it is made from (the
    arguments of TRL's ``create_model_card``) or the file itself changed since this run last wrote it."""

    def __init__(self):
        self._written = None  # what the card this run last wrote was made from, where, and the file's size and time

    def forget(self) -> None:
        """A new run: its first checkpoint writes the card."""
        self._written = None

    def current(self, inputs, output_dir: str) -> bool:
        """Whether the card in ``output_dir`` is the one this run last wrote from ``inputs``."""
        return self._written is not None and self._written == _card(inputs, output_dir)

    def write(self, write: Callable[[], None], inputs, output_dir: str) -> None:
        """Write the card and remember it.

        Args:
            write: writes it (TRL's ``create_model_card``).
            inputs: what it is made from.
            output_dir: where it is written.
        """
        write()
        self._written = _card(inputs, output_dir)


def _card(inputs, output_dir: str) -> tuple:
    path = Path(output_dir) / "README.md"
    return repr(inputs), str(path), _stamp(path)


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns
