"""A Trainer's ``checkpoint-N``: written whole into a hidden directory and renamed into place only once complete; with
``save_in_background``, every part of it (weights, optimizer and scheduler states, RNG states) is copied to CPU memory
in the foreground and written on the saves' thread.

``Checkpoints`` is the trainer's one object for it. ``save`` runs one checkpoint around Trainer's own
``_save_checkpoint``; ``reserve`` (at the end of the first training step, when every state exists) checks that the
copies fit in memory and allocates them, so that the first checkpoint blocks no longer than the others.
"""

import contextlib
import tempfile

from transformers.trainer_utils import rotate_checkpoints

from trl_ext.saving import pipeline
from trl_ext.saving.background import BackgroundSaves, StepBoundary
from trl_ext.saving.staged import StagedCheckpoint


class Checkpoints:
    """How a trainer writes its checkpoints.

    Args:
        trainer: the trainer (its ``args.save_in_background`` decides; its ``_writes_files`` says which ranks write).
    """

    def __init__(self, trainer):
        self.background = BackgroundSaves() if getattr(trainer.args, "save_in_background", False) else None
        self._foreground_why: str | None = None  # set when background saves cannot be used in this run
        self._reserved = False
        if self.background is not None:
            trainer.add_callback(StepBoundary(self.background, first_step=lambda: self.reserve(trainer)))

    def collecting(self) -> BackgroundSaves | None:
        """The background save being collected right now (inside a checkpoint's foreground part), or None."""
        return self.background if self.background is not None and self.background.collecting else None

    def in_background(self, trainer) -> bool:
        """Whether this checkpoint is written in the background: asked for and possible, and training goes on after
        it (the last one, and a preempted run's, are written in the foreground: nothing would run meanwhile)."""
        if self.background is None or self._foreground_why is not None:
            return False
        if trainer.args.push_to_hub:  # the upload starts from the checkpoint's files inside Trainer's own save
            self._say_foreground(trainer, "push_to_hub uploads each checkpoint's files as soon as it is saved")
            return False
        return not trainer.control.should_training_stop and trainer.state.global_step < trainer.state.max_steps

    def _say_foreground(self, trainer, why: str) -> None:
        self._foreground_why = why
        self.background.say_foreground(why)

    def save(self, trainer, name: str, save_checkpoint) -> None:
        """One checkpoint: ``save_checkpoint(staging_run_dir)`` (Trainer's own, told to write under the hidden
        directory) runs in the foreground; in the background its files are copied and queued there, and written once
        it returns. The checkpoint is renamed to ``name`` once complete, and older ones rotated out.

        Args:
            trainer: the trainer.
            name: ``checkpoint-N``.
            save_checkpoint: runs Trainer's ``_save_checkpoint`` with its output directory set to the given one.
        """
        writer = trainer._writes_files()
        in_background = self.in_background(trainer)
        if self.background is not None:
            self.background.wait(trainer.args.device)  # the previous checkpoint: committed, or its failure raised
        final = f"{trainer.args.output_dir}/{name}"
        release = self._release(trainer, final) if in_background else None
        with StagedCheckpoint(trainer.args.output_dir, name, writer, trainer.accelerator.wait_for_everyone,
                              release) as staged:
            if in_background:
                self.background.begin(str(staged.final))
            with self.background.deferring() if in_background else contextlib.nullcontext():
                save_checkpoint(str(staged.staging_run_dir))
            storage = trainer._storage
            if storage and not storage.shared and writer and trainer.is_deepspeed_enabled:
                # DeepSpeed writes its ``latest`` tag on global rank 0 only: each node's copy needs its own
                (staged.staging_run_dir / name / "latest").write_text(f"global_step{trainer.state.global_step}")
            if staged.staged_path(trainer.state.best_model_checkpoint):  # this checkpoint is the best so far
                trainer.state.best_model_checkpoint = str(staged.final)
                if trainer.args.should_save:
                    trainer.state.save_to_json(str(staged.staging_run_dir / name / "trainer_state.json"))
        if writer and not in_background:  # Trainer rotated inside the staging directory; rotate the real one
            self._committed(trainer, staged.final)

    def _release(self, trainer, final):
        def release(put_in_place) -> None:
            """The checkpoint's foreground part is done: write it; once committed, the writer renames it into place
            and rotates older ones out (on the saves' thread)."""

            def then():
                put_in_place()
                self._committed(trainer, final)

            self.background.release(then if put_in_place is not None else None)

        return release

    def _committed(self, trainer, path) -> None:
        """On the writer, once ``checkpoint-N`` is committed: the mirror is given it (``checkpoint_mirror``: hard links
        queued for upload), then older checkpoints are rotated out."""
        mirror = getattr(trainer, "_mirror", None)
        if mirror is not None:
            mirror.committed(path, int(str(path).rsplit("-", 1)[1]))  # not global_step: a background commit is later
        self._rotate(trainer)

    @staticmethod
    def _rotate(trainer) -> None:
        rotate_checkpoints(output_dir=trainer.args.output_dir, save_total_limit=trainer.args.save_total_limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)

    def reserve(self, trainer) -> None:
        """Once, at the end of the first training step, on every rank: the CPU copies a checkpoint needs, measured,
        checked against each machine's available memory (all ranks of a machine together) and allocated, so that no
        checkpoint allocates. Where they do not fit, checkpoints are saved in the foreground, said in one line."""
        if self.background is None or self._reserved or self._foreground_why is not None:
            return
        self._reserved = True
        model = trainer.model
        if not pipeline.supports(model):
            return
        settings = (getattr(trainer.args, "max_shard_size", pipeline.DEFAULT_MAX_SHARD_SIZE), trainer._writes_files())
        weights = pipeline.reserve(model, *settings, self.background, allocate=False)
        if weights is None:
            self._say_foreground(trainer, "some parameters are offloaded to NVMe, quantized or sharded over a 2-D "
                                          "mesh, whose parts cannot be copied")
            return
        self.background.measured = 0
        self._other_files(trainer, "measure")
        fits, short = self.background.fits(weights + self.background.measured)
        if not fits:
            self._say_foreground(trainer, f"their CPU copies need {short}")
            return
        pipeline.reserve(model, *settings, self.background, allocate=True)
        self._other_files(trainer, "reserve")

    def _other_files(self, trainer, mode: str) -> None:
        """Trainer's own writes of a checkpoint's other files, into a scratch directory, measured or copied."""
        if trainer.args.save_only_model:
            return
        with tempfile.TemporaryDirectory(prefix="trl_ext-reserve-") as scratch, self.background.deferring(mode):
            trainer._save_optimizer_and_scheduler(scratch)
            trainer._save_rng_state(scratch)
