"""A trainer's checkpoint mirror (``checkpoint_mirror``): the one object the trainer talks to.

    Mirror.for_args(args)         constructing the trainer, before the model loads, every rank: the store checked
                                  (credentials, bucket, permission), a refusal raised on every rank
    mirror.attach(trainer)        once the trainer exists: its callback joins the loop
    mirror.begin(trainer, ...)    train() starts, every rank: the run's lease; uploads an earlier run left finished
                                  or abandoned
    mirror.committed(path, step)  a checkpoint was committed locally, on the rank that writes: hard-linked and queued
    mirror.model_saved(path)      save_model() committed a model, on the rank that writes: the same
    mirror.status()               how far behind the mirror is (logged as ``mirror/...`` metrics)
    mirror.at_preemption(...)     the stopping checkpoint uploaded within ``mirror_grace_period``, or said to be local
    Progress (a callback)         renews the lease, logs the lag, raises an uploader's own error, says when training
                                  has ended
    at exit                       what is still queued is uploaded within ``mirror_exit_grace_period`` (default
                                  600 s), or said to be only local (kept in the outbox for the next run): the process
                                  ends

Only global rank 0 uploads: a mirror needs an output directory every node shares, where rank 0 commits every
checkpoint whole.
"""

import os
import shutil
from pathlib import Path

from transformers import TrainerCallback

from trl_ext import errors
from trl_ext.errors import MirrorError, TrlExtError
from trl_ext.files import checkpoint_dirs as checkpoints
from trl_ext.mirror import lease, options, outbox, uploader
from trl_ext.mirror.store import Store, first_line
from trl_ext.process import notice
from trl_ext.settings.trainer_options import MirrorOptions


def _as_error(exc: BaseException) -> TrlExtError:
    return exc if isinstance(exc, TrlExtError) else MirrorError(f"checkpoint_mirror: {first_line(exc)}")


def open_store(args) -> Store:
    """The store of ``args.checkpoint_mirror`` with ``args.mirror_storage_options``."""
    mirror = MirrorOptions.of(args)
    return Store(mirror.checkpoint_mirror, options.parse(mirror.mirror_storage_options))


def check(args) -> None:
    """Refuse a mirror this process cannot use (one line), before anything starts: the recipes and ``trl-ext
    <command>`` call it before they launch. Nothing is written but a probe, deleted at once.

    Raises:
        MirrorError: the store refuses the credentials, the bucket is missing, or writing is not allowed.
    """
    if MirrorOptions.of(args).checkpoint_mirror:
        open_store(args).check_access()


def local_checkpoints(output_dir: str | Path) -> list[int]:
    """The steps of the committed ``checkpoint-N`` folders of ``output_dir``, oldest first."""
    return list(checkpoints.committed(output_dir))


class Mirror:
    """One training run's mirror. Build it with ``for_args``.

    Args:
        args: the run's config.
        store: the store (global rank 0; None on the other ranks, which never touch it).
    """

    def __init__(self, args, store: Store | None):
        self.args, self.store = args, store
        self.url = options.shown(options.check_url(MirrorOptions.of(args).checkpoint_mirror))
        self.holder = lease.Holder(output_dir=os.path.abspath(args.output_dir))
        self.uploader: uploader.Uploader | None = None
        self._protected: set[int] = set()
        self._said_outside = False

    @classmethod
    def for_args(cls, args) -> "Mirror | None":
        """The mirror of ``args.checkpoint_mirror`` (None without one), its store checked on global rank 0 before any
        model loads; a refusal is raised on every rank. Collective in a distributed run.

        Args:
            args: the run's config (its process group set up: ``args.world_size`` was read).

        Raises:
            MirrorError: one line: the credentials, the bucket, the permission to write, or the URL.
        """
        if not MirrorOptions.of(args).checkpoint_mirror:
            return None
        store, error = None, None
        if args.process_index == 0:
            try:
                store = open_store(args)
                store.check_access()
            except Exception as exc:  # noqa: BLE001 - every rank raises the same one line below
                error = _as_error(exc)
        errors.agree(error)
        return cls(args, store)

    def attach(self, trainer) -> None:
        """Join ``trainer``'s loop (``Progress``: the lease renewed, the lag logged before TensorBoard's callback
        writes the step's metrics)."""
        self.args = trainer.args
        trainer.join(Progress(self), first=True, committed=self.committed)

    @property
    def grace(self) -> float:
        """``mirror_grace_period``, read when used: an edit to ``trainer.args`` before ``train()`` counts."""
        return float(MirrorOptions.of(self.args).mirror_grace_period)

    @property
    def exit_grace(self) -> float:
        """``mirror_exit_grace_period``, read when used (the uploader takes it as ``train()`` starts)."""
        return float(MirrorOptions.of(self.args).mirror_exit_grace_period)

    @property
    def writer(self) -> bool:
        return self.store is not None

    def begin(self, trainer, resuming: bool) -> None:
        """At the start of ``train()``, on every rank: rank 0 takes the mirror's lease (a new run may not take a mirror
        that holds another run's checkpoints; a resuming run may), finishes the uploads an earlier run on this machine
        left, and abandons those it cannot finish. A refusal is raised on every rank.

        Args:
            trainer: the trainer (its storage detected: the mirror needs one output directory every node shares).
            resuming: whether this run resumes (``resume_from_checkpoint``, a requeued job).

        Raises:
            MirrorError: another run writes there, or a new run would train over another run's checkpoints.
        """
        if self.uploader is not None:  # a second train() of the same trainer
            return
        error = None
        storage = getattr(trainer, "storage", None)
        if storage is not None and storage.multi_node and not storage.shared:
            error = MirrorError(f"checkpoint_mirror {self.url} needs an output_dir that every node shares (each "
                                "node's own output_dir holds only its ranks' parts of a checkpoint): put output_dir on "
                                "shared storage")
        elif self.writer:
            try:
                lease.claim(self.store, self.holder, resuming, notice)
                box = Path(self.args.output_dir) / outbox.DIR
                keep = self.args.save_total_limit or None
                self.uploader = uploader.Uploader(self.store, self.holder, box, keep,
                                                  lambda: set(self._protected), notice, self.exit_grace,
                                                  self.grace)
                self._finish_or_abandon()
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                error = _as_error(exc)
        errors.agree(error)
        if self.writer:
            notice(f"checkpoint_mirror: every committed checkpoint and the final model are uploaded to {self.url} "
                   "in the background")

    def _finish_or_abandon(self) -> None:
        """What an earlier run left: uploads in the outbox and committed local checkpoints the mirror lacks are
        uploaded; incomplete remote checkpoints that nothing here can finish are deleted."""
        up = self.uploader
        remote = self.store.checkpoints()
        complete = {s for s, done in remote.items() if done}
        up.remote_step = max(complete, default=None)
        queued = set()
        for job in outbox.pending(up.outbox_root):
            if job.step is not None and job.step in complete:
                shutil.rmtree(job.folder, ignore_errors=True)
                continue
            notice(f"checkpoint_mirror: finishing the upload of {job.name} that an earlier run left")
            up.submit(job)
            queued.add(job.step)
        for step in local_checkpoints(self.args.output_dir):
            if step not in complete and step not in queued:
                notice(f"checkpoint_mirror: checkpoint-{step} is committed locally but not in the mirror: uploading it")
                self.committed(Path(self.args.output_dir) / checkpoints.name(step), step)
                queued.add(step)
        for step, done in remote.items():
            if not done and step not in queued:
                rel = checkpoints.name(step)
                self.store.abort_uploads(rel)
                self.store.delete(rel)
                notice(f"checkpoint_mirror: deleted the incomplete upload of {self.store.url_of(rel)} that an earlier "
                       "run left (it never completed; no checkpoint here can finish it)")

    def committed(self, path: str | os.PathLike, step: int) -> None:
        """``checkpoint-<step>`` was committed locally at ``path``: its files are hard-linked into the outbox
        folder and queued for upload (milliseconds; training goes on). Call it on the rank that commits, before
        older checkpoints are rotated out.

        Args:
            path: the committed checkpoint.
            step: its step.
        """
        if self.uploader is None:
            return
        name = checkpoints.name(step)
        job = outbox.put(Path(path), self.uploader.outbox_root / name, name, step)
        self.uploader.submit(job)

    def model_saved(self, path: str | os.PathLike) -> None:
        """A model was saved and committed at ``path`` (``trainer.save_model``): its files are uploaded to the same
        place under the mirror as under the output directory (the mirror's top for ``output_dir`` itself).

        Args:
            path: the directory the model was saved to.
        """
        if self.uploader is None:
            return
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(self.args.output_dir))
        if rel.startswith(".."):
            if not self._said_outside:
                self._said_outside = True
                notice(f"checkpoint_mirror: {path} is outside output_dir, so it is not mirrored (models saved inside "
                       "output_dir are)")
            return
        rel = "" if rel == "." else rel.replace(os.sep, "/")
        folder = self.uploader.outbox_root / ("model" if not rel else "model@" + rel.replace("/", "@"))
        self.uploader.submit(outbox.put(Path(path), folder, rel, None, top_files_only=True))

    def protect(self, best_model_checkpoint: str | None) -> None:
        """The best model's checkpoint is kept by the remote retention, as by the local one."""
        step = checkpoints.step_of(best_model_checkpoint) if best_model_checkpoint else None
        self._protected = {step} if step is not None else set()

    def status(self) -> dict[str, float]:
        """How far behind the mirror is: ``behind_checkpoints``, ``behind_steps``, ``store_silent_seconds``."""
        return self.uploader.status() if self.uploader is not None else {}

    def at_preemption(self, barrier) -> None:
        """A preempted run is about to exit, on every rank: rank 0 gives the stopping checkpoint's upload up to
        ``mirror_grace_period`` seconds, then says whether it is in the mirror or only local; every rank waits for it
        (``barrier``), so no rank's exit cuts the upload short."""
        if self.uploader is not None:
            if self.uploader.wait(self.grace):
                notice(f"checkpoint_mirror: every committed checkpoint is in {self.url} (within the "
                       f"{self.grace:.0f} s grace period)")
            else:
                left = self.uploader.abandon()
                newest = self.uploader.remote_step
                notice(f"checkpoint_mirror: the {self.grace:.0f} s grace period (mirror_grace_period) ran out: "
                       f"{', '.join(left)} only local (kept in {self.uploader.outbox_root}); the mirror's newest "
                       f"complete checkpoint is {f'checkpoint-{newest}' if newest else 'none'}")
        barrier()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every committed checkpoint and saved model queued so far is in the mirror (or given up on). A
        process waits for them as it exits anyway (at most ``mirror_exit_grace_period``); this is for a script that
        wants to know.

        Args:
            timeout: seconds (None: as long as the uploads take).

        Returns:
            True when nothing is left to upload.
        """
        return self.uploader.wait(timeout) if self.uploader is not None else True

    def close(self) -> None:
        """Training has ended (uploads go on until done; the process waits for them as it exits, at most
        ``mirror_exit_grace_period``)."""
        if self.uploader is not None:
            self.uploader.close()


class Progress(TrainerCallback):
    """The mirror's side of the training loop: its lease renewed, its lag logged (``mirror/behind_checkpoints``,
    ``mirror/behind_steps``: TensorBoard and the console), the best checkpoint protected, and the end of training."""

    def __init__(self, mirror: Mirror):
        self.mirror = mirror

    def on_step_end(self, args, state, control, **kwargs):
        if self.mirror.uploader is not None:
            self.mirror.uploader.raise_if_broken()  # an error of our own: training stops, visibly (rank 0)
            self.mirror.uploader.renew_if_due()

    def on_save(self, args, state, control, **kwargs):
        self.mirror.protect(state.best_model_checkpoint)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self.mirror.uploader is not None:
            for key, value in self.mirror.status().items():
                if key != "store_silent_seconds" or value:
                    logs[f"mirror/{key}"] = value

    def on_train_end(self, args, state, control, **kwargs):
        self.mirror.close()
