"""A trainer's ``checkpoint-N``s, from the save to retention, in one object.

One checkpoint's life (``Checkpoints.save``, which the trainer's ``_save_checkpoint`` calls):

1. ``wait_for_writes``: the previous checkpoint is committed, or its failure raised, on every rank;
2. Trainer's own ``_save_checkpoint`` writes everything (weights, optimizer and scheduler, RNG states, trainer state)
   into a hidden directory, ``.checkpoint-N.trl_ext-partial/checkpoint-N`` (``Staging``), which
   ``resume_from_checkpoint=True`` never picks;
3. in the foreground, the directory is renamed to ``checkpoint-N``, the ``after_commit`` hooks run (the mirror) and
   older checkpoints are rotated out (``save_total_limit``); with ``save_in_background``:

   - ``begin`` returns one ``executor.Save``; inside Trainer's save, the weights (``pipeline.save(into=...)``) and every
     file the libraries write themselves (``deferred``) are staged in the ``snapshot``: small tensors copied at once,
     the others queued;
   - ``release`` starts the copies beside the next forward and backward and hands the save to the saves' thread;
   - ``wait_for_copies``: before the next optimizer step changes the originals (an optimizer step pre-hook);
   - on the saves' thread: the copies end, every part is written, synced and checked, every rank's outcome agreed on,
     the weights committed, the checkpoint renamed into place, the ``after_commit`` hooks run, older ones rotated
     out;
   - ``poll`` at the next step boundary after it finished (or ``wait_for_writes`` before the next checkpoint and at the
     end): its outcome on every rank, a failure raised on all of them;
4. its cost is logged as training metrics (the log line, TensorBoard; ``history``, not ``state.log_history``, whose
   copy in each checkpoint must not depend on timing): ``checkpoint/held_s`` (how long the training
   thread was held for it: inside ``_save_checkpoint``, ``checkpoint/held_save_s``; before the next optimizer step,
   ``checkpoint/held_copy_wait_s``, on a GPU the compute stream's wait included; for the previous checkpoint,
   ``checkpoint/held_previous_s``), ``checkpoint/write_s`` (its files written, synced, checked and committed) and
   ``checkpoint/bytes`` (the committed directory), each the slowest rank's.

At the end of the first training step (``reserve``), every copy a checkpoint needs is measured, checked against each
machine's available memory (its ranks added up) and allocated, so that no checkpoint allocates; where the copies do
not fit, checkpoints are saved in the foreground, said in one line.
"""

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_utils import rotate_checkpoints

from trl_ext import errors
from trl_ext.files.commit import PARTIAL_SUFFIX, replace_dir
from trl_ext.process import distributed, logger, notice
from trl_ext.saving import deferred, pipeline
from trl_ext.saving.executor import Executor, Mode, Save, failed
from trl_ext.saving.snapshot import Snapshot

METRICS = ("checkpoint/held_s", "checkpoint/held_save_s", "checkpoint/held_copy_wait_s", "checkpoint/held_previous_s",
           "checkpoint/write_s", "checkpoint/bytes")
CPU_COST = ("the copies and writes of each checkpoint run on the cores training uses, so they slow the steps after "
            "it: on 2 cores, runs with background checkpoints took {ratio} the time of the same runs with foreground "
            "ones (docs/saving.md#on-a-cpu)")


class Staging:
    """A whole Trainer checkpoint written in a hidden directory and renamed to ``checkpoint-N`` only once complete.

    Everything the Trainer writes lands in ``<run_dir>/.checkpoint-N.trl_ext-partial/checkpoint-N`` first. A crash or
    kill mid-save leaves only that hidden directory, which ``get_last_checkpoint`` and ``resume_from_checkpoint=True``
    never pick, and which the next save removes.

    Args:
        run_dir: the output directory.
        name: ``checkpoint-N``.
        is_writer: this rank creates, renames and rotates (the others only write their files into it).
    """

    def __init__(self, run_dir: str, name: str, is_writer: bool):
        self.run_dir, self.name, self.is_writer = Path(run_dir), name, is_writer
        self.staging_run_dir = self.run_dir / f".{name}{PARTIAL_SUFFIX}"
        self.final = self.run_dir / name

    def create(self) -> None:
        """The writer: an empty hidden directory, and none left by interrupted saves."""
        if self.is_writer:
            for stale in self.run_dir.glob(f".checkpoint-*{PARTIAL_SUFFIX}"):
                shutil.rmtree(stale, ignore_errors=True)
            self.staging_run_dir.mkdir(parents=True)

    def holds(self, path: str | None) -> bool:
        """Whether ``path`` lies in the hidden directory."""
        return bool(path) and Path(path).absolute().is_relative_to(self.staging_run_dir.absolute())

    def put_in_place(self) -> None:
        """The writer: the complete checkpoint renamed to ``checkpoint-N``."""
        replace_dir(self.staging_run_dir / self.name, self.final)
        self.staging_run_dir.rmdir()


def _torch_optimizers(trainer) -> list[torch.optim.Optimizer]:
    """The innermost torch optimizer under accelerate's and DeepSpeed's wrappers (accelerate's is a torch optimizer
    too), whose step changes the originals: the trainer's, and a DeepSpeed engine's."""
    found = []
    for optimizer in (trainer.optimizer, getattr(trainer.model_wrapped, "optimizer", None)):
        innermost = None
        while optimizer is not None:
            if isinstance(optimizer, torch.optim.Optimizer):
                innermost = optimizer
            optimizer = getattr(optimizer, "optimizer", None)
        if innermost is not None and all(innermost is not f for f in found):
            found.append(innermost)
    return found


def _file_stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns


def _directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class Checkpoints:
    """A trainer's checkpoints (see the module docstring). Create one per trainer, on every rank.

    Args:
        trainer: the trainer (its ``args.save_in_background`` decides; its ``_writes_files`` says which ranks write).
    """

    def __init__(self, trainer):
        self.trainer = trainer
        background = bool(getattr(trainer.args, "save_in_background", False))
        self.executor = Executor() if background else None
        self.snapshot = Snapshot(pinned=torch.cuda.is_available()) if background else None
        self.collecting: Save | None = None  # the background save Trainer's _save_checkpoint is writing into
        self.in_flight: Save | None = None  # released, until its outcome is known on every rank
        self.after_commit: list[Callable[[Path, int], None]] = []  # the writer's hooks, once a checkpoint is in place
        self.history: list[dict] = []  # each checkpoint's cost, as logged
        self.last: Save | None = None  # the last background checkpoint, once its outcome is known
        self._foreground_why: str | None = None  # set when background saves cannot be used in this run
        self._reserved = False
        self.measured = 0  # the bytes the first step's reserve measured for every copy (what it then allocates)
        self._hooked: list = []  # the optimizers hooked (a later train() may bring a new one)
        self._unhooked = False  # no optimizer to hook: each checkpoint's copies end before it returns
        self._said_cpu_cost = False
        self._taking = False  # inside save: Trainer's _save_checkpoint is running
        self._card = None  # the model card this run last wrote: what it was made from, and the file's size and time
        trainer.add_callback(CheckpointCallback(self))

    # The lifecycle

    def save(self, name: str, save_checkpoint: Callable[[str], None]) -> None:
        """One checkpoint, on every rank: ``save_checkpoint(staging_run_dir)`` (Trainer's own, told to write under the
        hidden directory) runs now; in the background its files are staged there and written once it returns. The
        checkpoint is renamed to ``name`` once complete, and older ones rotated out.

        Args:
            name: ``checkpoint-N``.
            save_checkpoint: runs Trainer's ``_save_checkpoint`` with its output directory set to the given one.
        """
        trainer = self.trainer
        previous = self.wait_for_writes()
        start = time.monotonic()
        writer = trainer._writes_files()
        staging = Staging(trainer.args.output_dir, name, writer)
        save = self.begin(staging.final) if self._in_background() else None
        try:
            staging.create()
            trainer.accelerator.wait_for_everyone()
            self._taking = True
            with deferred.deferred_writes(save) if save is not None else contextlib.nullcontext():
                save_checkpoint(str(staging.staging_run_dir))
            self._finish_trainer_files(staging, name, writer)
            trainer.accelerator.wait_for_everyone()  # every rank has written its files (RNG state, optimizer shards)
        finally:
            self.collecting, self._taking = None, False
        if save is not None:
            save.costs = {"checkpoint/held_previous_s": previous}
            self.release(save, on_commit=lambda: self._committed(staging, save))
            save.costs["checkpoint/held_save_s"] = time.monotonic() - start
            self._say_cpu_cost()
            return
        self._committed(staging)
        trainer.accelerator.wait_for_everyone()
        held = time.monotonic() - start
        self._log({"checkpoint/held_previous_s": previous, "checkpoint/held_save_s": held,
                   "checkpoint/held_copy_wait_s": 0.0, "checkpoint/write_s": held,
                   "checkpoint/bytes": _directory_bytes(staging.final) if writer else 0})

    def begin(self, target: Path) -> Save:
        """A background checkpoint of ``target``, collected from now on (``collecting``), on every rank."""
        self.snapshot.begin()
        # the model's buffers: a forward pass may change them before the next optimizer step
        self.snapshot.copy_at_once = {b.untyped_storage()._cdata for b in self.trainer.model.buffers()}
        save = Save(target, self.executor, self.snapshot)
        save.foreground = self._say_foreground
        self.collecting = save
        return save

    def release(self, save: Save, on_commit: Callable[[], None]) -> None:
        """``save`` is collected: its copies start beside training and the saves' thread writes it; ``on_commit`` runs
        there once it is committed on every rank."""
        save.commits.append(on_commit)
        self.snapshot.start()
        self.in_flight = save
        if self._unhooked:  # counted in held_save_s
            self.snapshot.wait_for_copies()
            save.copies_waited = True
        self.executor.run(save)

    def wait_for_copies(self) -> None:
        """Before anything changes the originals (the optimizer step): the checkpoint's copies are complete (on a
        GPU, ordered before the compute stream's next work)."""
        save = self.in_flight
        if save is None or save.copies_waited:
            return
        save.copies_waited = True
        save.costs["checkpoint/held_copy_wait_s"] = self.snapshot.wait_for_copies()

    def wait_for_writes(self, log: bool = True) -> float:
        """Until the checkpoint in flight (if any) is committed, on every rank (a collective then); its failure raised
        on every rank, its cost logged (with ``log``).

        Returns:
            The seconds waited.

        Raises:
            CheckpointError: the background save failed on some rank; nothing of it was committed.
        """
        if self.in_flight is None:
            return 0.0
        start = time.monotonic()
        self.executor.join()
        waited = time.monotonic() - start
        self._outcome(log)
        return waited

    def poll(self) -> None:
        """At a step boundary, on every rank: if the checkpoint in flight has finished on every rank, its outcome (a
        failure raised on every rank) and its cost. One all-reduce of one number while a save is in flight; nothing
        otherwise.

        Raises:
            CheckpointError: the background save failed; nothing of it was committed.
        """
        if self.in_flight is None:
            return
        running = int(self.executor.running())
        if distributed():
            flag = torch.tensor([running], dtype=torch.int64, device=self.trainer.args.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            running = int(flag.item())
        if not running:
            self.wait_for_writes()

    def _outcome(self, log: bool) -> None:
        save, self.in_flight = self.in_flight, None
        self.last = save
        self.wait_for_copies()  # training ended before an optimizer step: counted here
        error = save.error
        # Every rank's outcome, of its class and kind (the thread's agreement already made them one).
        errors.agree(None if error is None else failed(error), prefer=(errors.NONFINITE,))
        costs = {**save.costs, "checkpoint/write_s": save.write_s, "checkpoint/bytes": save.committed_bytes}
        costs["checkpoint/held_copy_wait_s"] = costs.get("checkpoint/held_copy_wait_s", 0.0) + self.snapshot.gpu_stall()
        self._log(costs, log)

    def abandon(self, timeout: float = 60.0) -> None:
        """Training stopped with an error: the checkpoint in flight is not committed if it has not been yet; its
        thread is given ``timeout`` seconds to end. No collective call: the other ranks may be gone."""
        self.collecting = None
        if self.in_flight is not None:
            self.in_flight.cancelled = True
            self.executor.join(timeout)
            self.in_flight = None

    # What runs around the lifecycle

    def _in_background(self) -> bool:
        """Whether this checkpoint is written in the background: asked for and possible, and training goes on after
        it (the last one, and a preempted run's, are written in the foreground: nothing would run meanwhile)."""
        trainer = self.trainer
        if self.executor is None or self._foreground_why is not None:
            return False
        if trainer.args.push_to_hub:  # the upload starts from the checkpoint's files inside Trainer's own save
            self._say_foreground("push_to_hub uploads each checkpoint's files as soon as it is saved")
            return False
        return not trainer.control.should_training_stop and trainer.state.global_step < trainer.state.max_steps

    def _finish_trainer_files(self, staging: Staging, name: str, writer: bool) -> None:
        trainer = self.trainer
        storage = trainer._storage
        if storage and not storage.shared and writer and trainer.is_deepspeed_enabled:
            # DeepSpeed writes its ``latest`` tag on global rank 0 only: each node's copy needs its own
            (staging.staging_run_dir / name / "latest").write_text(f"global_step{trainer.state.global_step}")
        if staging.holds(trainer.state.best_model_checkpoint):  # this checkpoint is the best so far
            trainer.state.best_model_checkpoint = str(staging.final)
            if trainer.args.should_save:
                trainer.state.save_to_json(str(staging.staging_run_dir / name / "trainer_state.json"))

    def write_model_card(self, write: Callable[[], None], inputs) -> None:
        """TRL's trainers write the run's model card (``output_dir/README.md``) at every checkpoint, the same each time:
        inside a checkpoint it is written only when what it is made from (``inputs``, the arguments of TRL's
        ``create_model_card``) or the file changed since this run last wrote it (on every checkpoint it held training
        13-23 ms).

        Args:
            write: writes the card (TRL's ``create_model_card``).
            inputs: what it is made from.
        """
        path = Path(self.trainer.args.output_dir) / "README.md"
        made_from = (repr(inputs), str(path))
        if self._taking and self._card == (made_from, _file_stamp(path)):
            return
        write()
        self._card = (made_from, _file_stamp(path))

    def _committed(self, staging: Staging, save: Save | None = None) -> None:
        """The writer: the checkpoint renamed into place, the ``after_commit`` hooks (the mirror; a hook's failure is
        said, never undoes the commit), then older checkpoints rotated out."""
        if not staging.is_writer:
            return
        staging.put_in_place()
        if save is not None:
            save.committed_bytes = _directory_bytes(staging.final)
        step = int(staging.name.rpartition("-")[2])  # not global_step: a background commit lands steps later
        for hook in self.after_commit:
            try:
                hook(staging.final, step)
            except Exception as exc:  # noqa: BLE001 - the checkpoint is committed; what follows it is the hook's
                logger.warning(f"[trl_ext] after {staging.final} was committed: {type(exc).__name__}: {exc}")
        trainer = self.trainer
        rotate_checkpoints(output_dir=trainer.args.output_dir, save_total_limit=trainer.args.save_total_limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)

    def _log(self, costs: dict, log: bool = True) -> None:
        """A checkpoint's cost, the slowest rank's, recorded and logged as training metrics (every rank at the same
        point: a collective when distributed)."""
        costs = {"checkpoint/held_s": sum(costs.get(k, 0.0) for k in METRICS[1:4]), **costs}
        values = [float(costs.get(k, 0.0)) for k in METRICS]
        if distributed():
            reduced = torch.tensor(values, dtype=torch.float64, device=self.trainer.args.device)
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
            values = reduced.tolist()
        record = {k: round(v, 4) for k, v in zip(METRICS, values)}
        record["checkpoint/bytes"] = int(values[-1])
        self.history.append(record)
        if log:  # to the loggers, not into log_history: a checkpoint's trainer_state.json must not depend on timing
            trainer = self.trainer
            logs = {**record, **({"epoch": trainer.state.epoch} if trainer.state.epoch is not None else {})}
            # the callbacks' on_log, without CallbackHandler.on_log's reset of should_log: the step's own log follows
            trainer.callback_handler.call_event("on_log", trainer.args, trainer.state, trainer.control, logs=logs)

    def _say_foreground(self, why: str) -> None:
        """Checkpoints are saved in the foreground from now on; said once."""
        if self._foreground_why is None:
            self._foreground_why = why
            notice(f"save_in_background: checkpoints are saved in the foreground, because {why}.")

    def _say_cpu_cost(self) -> None:
        """At the first background checkpoint of a run whose processes use every core of a CPU-only machine: what the
        background costs there."""
        if self._said_cpu_cost or self.trainer.args.device.type != "cpu":
            return
        self._said_cpu_cost = True
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if local * torch.get_num_threads() >= cores:
            notice(f"save_in_background on a CPU ({local} training process(es) x {torch.get_num_threads()} "
                   f"thread(s) on {cores} cores): {CPU_COST.format(ratio='0.77-1.14x')}.")

    # At the first step and at every optimizer step

    def hook_optimizer(self) -> None:
        """When training starts: ``wait_for_copies`` before every step of the optimizers that change the originals.
        Where there are none to hook (an optimizer that is not a torch one), the copies are made before each
        checkpoint returns instead."""
        if self.executor is None:
            return
        optimizers = _torch_optimizers(self.trainer)
        for optimizer in optimizers:
            if all(optimizer is not hooked for hooked in self._hooked):
                optimizer.register_step_pre_hook(lambda *args: self.wait_for_copies())
                self._hooked.append(optimizer)
        self._unhooked = not optimizers

    def reserve(self) -> None:
        """Once, at the end of the first training step, on every rank: the CPU copies a checkpoint needs, measured,
        checked against each machine's available memory (all ranks of a machine together) and allocated, so that no
        checkpoint allocates. Where they do not fit, checkpoints are saved in the foreground, said in one line."""
        if self.executor is None or self._reserved or self._foreground_why is not None:
            return
        self._reserved = True
        trainer = self.trainer
        if not pipeline.supports(trainer.model):
            return
        settings = (getattr(trainer.args, "max_shard_size", pipeline.DEFAULT_MAX_SHARD_SIZE), trainer._writes_files())
        measure = Save(Path(), self.executor, self.snapshot, Mode.MEASURE)
        if pipeline.reserve(trainer.model, *settings, measure) is None:
            self._say_foreground(pipeline.CANNOT_COPY)
            return
        self._other_files(measure)
        self.measured = measure.measured
        fits, short = self._fits(measure.measured)
        if not fits:
            self._say_foreground(f"their CPU copies need {short}")
            return
        self.snapshot.begin()
        self.snapshot.worker.start()  # now, so that no checkpoint waits for a thread to start
        self.executor.worker.start()
        self.executor.group()  # the saves' process group too, so that no checkpoint creates it (every rank is here)
        reserve = Save(Path(), self.executor, self.snapshot, Mode.RESERVE)
        pipeline.reserve(trainer.model, *settings, reserve)
        self._other_files(reserve)
        self.snapshot.begin()  # what the reserve copied is not kept alive until the first checkpoint

    def _other_files(self, save: Save) -> None:
        """Trainer's own writes of a checkpoint's other files, into a scratch directory, measured or copied."""
        if self.trainer.args.save_only_model:
            return
        with tempfile.TemporaryDirectory(prefix="trl_ext-reserve-") as scratch, deferred.deferred_writes(save):
            self.trainer._save_optimizer_and_scheduler(scratch)
            self.trainer._save_rng_state(scratch)

    @staticmethod
    def _fits(need: int) -> tuple[bool, str]:
        """Whether every rank's CPU copies fit in its machine's available memory (ranks on one machine added up), the
        same answer on every rank; and, when not, the one line saying how much was needed."""
        import socket

        import psutil

        mine = (socket.gethostname(), need, psutil.virtual_memory().available)
        everyone = [mine]
        if distributed():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        short = []
        for host in sorted({h for h, _, _ in everyone}):
            needed = sum(n for h, n, _ in everyone if h == host)
            available = min(a for h, _, a in everyone if h == host)
            if needed > available:
                short.append(f"{needed / 2**30:.2f} GiB on {host}, where {available / 2**30:.2f} GiB is available")
        return not short, "; ".join(short)


class CheckpointCallback(TrainerCallback):
    """``Checkpoints`` at the points of Trainer's loop: the optimizers hooked when training starts; at every step
    boundary, the first step's reserve and the outcome of a checkpoint in flight; at the end, the wait for it."""

    def __init__(self, checkpoints: Checkpoints):
        self.checkpoints = checkpoints

    def on_train_begin(self, args, state, control, **kwargs):
        self.checkpoints._card = None  # a new run writes its model card again
        self.checkpoints.hook_optimizer()

    def on_step_end(self, args, state, control, **kwargs):
        self.checkpoints.reserve()
        self.checkpoints.poll()

    def on_train_end(self, args, state, control, **kwargs):
        # after Trainer's last log line: the cost is recorded (``history``), not logged
        self.checkpoints.wait_for_writes(log=False)
