"""A trainer's ``checkpoint-N``s in one object, ``Checkpoints``, on every rank. Its lifecycle:

- ``take``: Trainer's ``_save_checkpoint`` writes the checkpoint into a hidden directory
  (``trainer_files.PartialDir``). In the foreground it is committed before ``take`` returns. In the background
  (``mode``) it is collected meanwhile (``collecting``: the weights through ``pipeline.save(into=...)``, every other
  file through ``deferred``), its copies start beside the next forward and backward, and the executor's thread writes
  it (``in_flight``): the copies end, every part is written, synced and checked, every rank's outcome agreed on, the
  checkpoint committed, the ``after_commit`` hooks run (the mirror), older ones rotated out.
- ``wait_for_copies``: before the next optimizer step changes what was copied (an optimizer step pre-hook).
- ``poll``: at each step boundary, once the executor's thread is done on every rank, the outcome.
- ``wait_for_writes``: before the next checkpoint and at the end, until the checkpoint in flight is committed, or its
  failure raised, on every rank.
- ``close``: at the end of ``train()`` (and at exit), the copies' and the executor's threads ended.
- ``abandon``: training stopped with an error; the checkpoint in flight is not committed.

One background checkpoint, step by step, with the module of ``saving`` that does each step:

    once, at the end of the first step: the copies measured, checked, allocated   reserve.reserve_copies
    on the training thread, in take():
      1. the previous checkpoint's outcome; a hidden partial directory            trainer_files.PartialDir
      2. Trainer's _save_checkpoint runs; nothing is written, every part staged   executor.BackgroundCheckpoint
         (its CPU copies) and queued: the weights                                 pipeline.save(into=...)
         and the files Trainer, DeepSpeed and accelerate write                    deferred
         into buffers kept from one checkpoint to the next                        snapshot.Snapshot
      3. the copies start beside the next forward and backward                    snapshot (a CUDA stream or a thread)
      4. before the next optimizer step, the copies complete (wait_for_copies)    mode.OptimizerHooks
    on the executor's thread (its own gloo group):                                executor.Executor
      5. every part written, synced and read back                                 write, gather, files.readback
      6. every rank's outcome agreed on                                           errors.agree
      7. the weights renamed into the checkpoint, the checkpoint into place,      save_plan.Save.commit_save,
         the after_commit hooks run (the mirror, Ray's reports), older ones       trainer_files.commit_checkpoint
         rotated out
    back on the training thread, at a step boundary (poll) or wait_for_writes:
      8. the outcome on every rank (a failure raised on all of them), its cost    cost.Cost
    throughout: foreground or background, and why (Where: FOREGROUND,             mode.Mode
    BACKGROUND, BACKGROUND_COPIED_FIRST); what a BackgroundCheckpoint is for      executor.Purpose
    (WRITE; RESERVE and MEASURE for the reserve)

The words are the glossary's (``saving/__init__.py``).
"""

import contextlib
import functools
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import TrainerCallback

from trl_ext import errors
from trl_ext.process.notices import notice
from trl_ext.saving import deferred
from trl_ext.saving.cost import MEMORY_PREFIX, PREFIX, Cost, max_over_ranks
from trl_ext.saving.executor import BackgroundCheckpoint, Executor, as_failure
from trl_ext.saving.memory_replicas import note_alone, replicate
from trl_ext.saving.memory_tier import MemoryTier
from trl_ext.saving.mode import Mode, OptimizerHooks, Where, say_cpu_cost
from trl_ext.saving.reserve import reserve_copies
from trl_ext.saving.snapshot import Snapshot, storage_key
from trl_ext.saving.trainer_files import ModelCard, PartialDir, commit_checkpoint, fix_trainer_files

SAY_WAIT_SECONDS = 0.5  # a checkpoint that waited this long for the previous one's write says so, once per run


class Checkpoints:
    """A trainer's checkpoints (see the module docstring). Create one per trainer, on every rank.

    Args:
        trainer: the trainer (its ``args.save_in_background`` decides; its ``writes_files()`` says which ranks
            write; its ``args.memory_checkpoint_steps`` asks for the memory tier, ``memory``). It adds ``callback`` to
            its loop (``trainer.join``).
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.mode = Mode.asked(trainer.args)
        self.memory = MemoryTier.of(trainer.args)  # None: no memory checkpoints asked for
        # the copy stage and the executor's thread: background disk checkpoints, and every memory checkpoint
        self.copies = self.mode.background or self.memory is not None
        self.executor = Executor() if self.copies else None
        self.snapshot = Snapshot(pinned=torch.cuda.is_available()) if self.copies else None
        self.collecting: BackgroundCheckpoint | None = None  # what Trainer's _save_checkpoint is writing into
        self.in_flight: BackgroundCheckpoint | None = None  # taken, until its outcome is known on every rank
        self.last: BackgroundCheckpoint | None = None  # the last background checkpoint whose outcome is known
        self.after_commit: list[Callable[[Path, int], None]] = []  # the writer's hooks, once a checkpoint is in place
        self.history: list[Cost] = []  # each checkpoint's cost, the slowest rank's, as logged
        self.memory_history: list[Cost] = []  # the same for each memory checkpoint
        self.taken_step = -1  # the step of the last checkpoint taken (a memory checkpoint is not due there)
        self.measured = 0  # the bytes the first step's reserve measured for the copies (what it then allocated)
        self.model_card = ModelCard()
        self._hooks = OptimizerHooks(lambda: self.wait_for_copies())
        self._reserved = False
        self._taking = False
        self._said_cpu_cost = False
        self._said_waits = False
        self._copied_first = False  # no torch optimizer to hook: the copies end before each checkpoint returns
        self.callback = CheckpointCallback(self)  # the lifecycle at the points of Trainer's loop

    # The lifecycle

    def take(self, name: str, trainer_save: Callable[[str], None], memory: bool = False) -> None:
        """One checkpoint, on every rank: ``trainer_save(partial_dir)`` (Trainer's ``_save_checkpoint``, told to write
        under the hidden directory) runs now; in the background its files are staged (their CPU copies) and written
        once it returns. The checkpoint is renamed to ``name`` once complete, and older ones rotated out.

        Args:
            name: ``checkpoint-N``.
            trainer_save: runs Trainer's ``_save_checkpoint`` with its output directory set to the given one.
            memory: a memory checkpoint (``memory``'s directory, always in the background, the newest one kept)
                rather than one in the output directory.
        """
        trainer = self.trainer
        previous = self.wait_for_writes()
        if previous >= SAY_WAIT_SECONDS and not self._said_waits:
            self._said_waits = True
            option, prefix = ("memory_checkpoint_steps", MEMORY_PREFIX) if memory else ("save_steps", PREFIX)
            notice(f"{'memory_checkpoint_steps' if memory else 'save_in_background'}: {name} waited {previous:.1f} s "
                   "for the previous checkpoint's write to end: checkpoints are due faster than the disk writes them, "
                   f"so each waits for the one before (none is skipped). To train without waiting, set {option} to at "
                   f"least twice a write's time ({prefix}write_s in the logs) over a step's time "
                   "(docs/saving.md#in-the-background).")
        start = time.monotonic()
        self.taken_step = trainer.state.global_step
        if memory:  # node-local: each machine's first process writes its machine's files
            partial = PartialDir(str(self.memory.root), name, trainer.args.local_process_index == 0)
        else:
            partial = PartialDir(trainer.args.output_dir, name, trainer.writes_files())
        checkpoint = self._collect(partial.final) if memory or self._in_background() else None
        try:
            partial.create()
            trainer.accelerator.wait_for_everyone()
            self._taking = True
            with deferred.deferred_writes(checkpoint) if checkpoint is not None else contextlib.nullcontext():
                trainer_save(str(partial.path))
            fix_trainer_files(trainer, partial)
            trainer.accelerator.wait_for_everyone()  # every rank has written its files (RNG state, optimizer shards)
        finally:
            self.collecting, self._taking = None, False
        if checkpoint is None:
            written = commit_checkpoint(trainer, partial, self.after_commit)
            trainer.accelerator.wait_for_everyone()
            held = time.monotonic() - start
            self._record(Cost(held_save_s=held, held_previous_s=previous, write_s=held, bytes=written))
            return

        def committed() -> None:  # on the executor's thread, once every rank's every part succeeded
            if memory and self.memory.replicated:  # its manifest once every machine holds its peer's replica
                checkpoint.cost.bytes = commit_checkpoint(trainer, partial, [], rotate=False)
                replicate(self.memory.machines, trainer.args.world_size, partial.final, checkpoint.group())
                if partial.is_writer:
                    self.memory.committed(partial.final, partial.step)
            elif memory:  # one machine's, noted as its whole part for a run that grows to several
                alone = functools.partial(note_alone, trainer.args.world_size)
                checkpoint.cost.bytes = commit_checkpoint(trainer, partial, [alone, self.memory.committed],
                                                          rotate=False)
            else:
                checkpoint.cost.bytes = commit_checkpoint(trainer, partial, self.after_commit)

        checkpoint.memory = memory
        checkpoint.cost.held_previous_s = previous
        self._release(checkpoint, committed)
        checkpoint.cost.held_save_s = time.monotonic() - start
        if not self._said_cpu_cost:
            self._said_cpu_cost = True
            say_cpu_cost(trainer.args.device, "memory_checkpoint_steps" if memory else "save_in_background")

    def wait_for_copies(self) -> None:
        """Before anything changes the originals (the optimizer step): the checkpoint's copies are complete (on a
        GPU, ordered before the compute stream's next work)."""
        checkpoint = self.in_flight
        if checkpoint is None or checkpoint.copies_waited:
            return
        checkpoint.copies_waited = True
        checkpoint.cost.held_copy_wait_s = self.snapshot.wait_for_copies()

    def poll(self) -> None:
        """At a step boundary, on every rank: if the checkpoint in flight has finished on every rank, its outcome (a
        failure raised on every rank) and its cost. One all-reduce of one number while a checkpoint is in flight;
        nothing otherwise.

        Raises:
            CheckpointError: the background checkpoint failed; nothing of it was committed.
        """
        if self.in_flight is None:
            return
        if not max_over_ranks([float(self.executor.running())], self.trainer.args.device)[0]:
            self.wait_for_writes()

    def wait_for_writes(self, log: bool = True) -> float:
        """Until the checkpoint in flight (if any) is committed, on every rank (a collective then); its failure raised
        on every rank, its cost logged (with ``log``).

        Returns:
            The seconds waited.

        Raises:
            CheckpointError: the background checkpoint failed on some rank; nothing of it was committed.
        """
        if self.in_flight is None:
            return 0.0
        start = time.monotonic()
        self.executor.join()
        waited = time.monotonic() - start
        checkpoint, self.in_flight = self.in_flight, None
        self.last = checkpoint
        self.wait_for_copies()  # training ended before an optimizer step: counted here
        # Every rank's outcome, of its class and kind (the executor's agreement already made them one).
        errors.agree(None if checkpoint.error is None else as_failure(checkpoint.error), prefer=(errors.NONFINITE,))
        checkpoint.cost.held_copy_wait_s += self.snapshot.gpu_stall()
        self._record(checkpoint.cost, log, memory=checkpoint.memory)
        return waited

    def close(self, timeout: float | None = None) -> None:
        """The copies' and the executor's threads ended once their work is done (waiting at most ``timeout`` seconds
        each); a later checkpoint starts them again. No collective call."""
        if self.executor is not None:
            self.executor.close(timeout)
            self.snapshot.close(timeout)

    def end(self) -> None:
        """Training completed: the memory tier's checkpoints are no longer needed; its memory given back (this
        machine's first process)."""
        if self.memory is not None and self.trainer.args.local_process_index == 0:
            self.memory.clear()

    def abandon(self, timeout: float = 60.0) -> None:
        """Training stopped with an error: the checkpoint in flight is not committed if it has not been yet; the
        threads are given ``timeout`` seconds to end. No collective call: the other ranks may be gone."""
        self.collecting = None
        if self.in_flight is not None:
            self.in_flight.cancelled = True
            self.executor.join(timeout)
            self.in_flight = None
        self.close(timeout=0)

    # Around the lifecycle

    def _in_background(self) -> bool:
        """Whether this checkpoint is written in the background: the mode says so, and training goes on after it (the
        last one, and a preempted run's, are written in the foreground: nothing would run meanwhile)."""
        trainer = self.trainer
        if trainer.args.push_to_hub:  # the upload starts from the checkpoint's files inside Trainer's own save
            self._go_foreground("push_to_hub uploads each checkpoint's files as soon as it is saved")
        return (self.mode.background and not trainer.control.should_training_stop
                and trainer.state.global_step < trainer.state.max_steps)

    def _go_foreground(self, why: str) -> None:
        self.mode = self.mode.foreground(why)

    def _collect(self, target: Path) -> BackgroundCheckpoint:
        """A background checkpoint of ``target``, collected from now on (``collecting``), on every rank."""
        self.snapshot.begin()
        # the model's buffers: a forward pass may change them before the next optimizer step
        self.snapshot.copy_at_once = {storage_key(b.untyped_storage()) for b in self.trainer.model.buffers()}
        checkpoint = BackgroundCheckpoint(target, self.executor, self.snapshot)
        checkpoint.say_foreground = self._go_foreground
        self.collecting = checkpoint
        return checkpoint

    def _release(self, checkpoint: BackgroundCheckpoint, on_commit: Callable[[], None]) -> None:
        """``checkpoint`` is collected: its copies start beside training and the executor's thread writes it;
        ``on_commit`` runs there once it is committed on every rank."""
        checkpoint.commits.append(on_commit)
        self.snapshot.start()
        self.in_flight = checkpoint
        if self._copied_first:  # counted in held_save_s
            self.snapshot.wait_for_copies()
            checkpoint.copies_waited = True
        self.executor.run(checkpoint)

    def _record(self, cost: Cost, log: bool = True, memory: bool = False) -> None:
        """A checkpoint's cost, the slowest rank's, recorded and logged as training metrics (every rank at the same
        point: a collective when distributed)."""
        trainer = self.trainer
        slowest = cost.slowest(trainer.args.device)
        (self.memory_history if memory else self.history).append(slowest)
        if log:  # to the loggers, not into log_history: a checkpoint's trainer_state.json must not depend on timing
            epoch = {"epoch": trainer.state.epoch} if trainer.state.epoch is not None else {}
            logs = {**slowest.metrics(MEMORY_PREFIX if memory else PREFIX), **epoch}
            # the callbacks' on_log, without CallbackHandler.on_log's reset of should_log: the step's own log follows
            trainer.callback_handler.call_event("on_log", trainer.args, trainer.state, trainer.control, logs=logs)

    def write_model_card(self, write: Callable[[], None], inputs) -> None:
        """TRL's ``create_model_card`` (``write``, made from ``inputs``): at a checkpoint, only when the card would
        change (``trainer_files.ModelCard``); in a background checkpoint, on the executor's thread with its files."""
        output_dir = self.trainer.args.output_dir
        if self._taking and self.model_card.current(inputs, output_dir):
            return
        checkpoint = self.collecting
        if checkpoint is None:
            self.model_card.write(write, inputs, output_dir)
        else:
            checkpoint.add("README.md", functools.partial(self.model_card.write, write, inputs, output_dir))

    # When training starts, and at the end of its first step

    def start(self) -> None:
        """When training starts: the model card written again at the first checkpoint; with background checkpoints,
        ``wait_for_copies`` hooked before the optimizers' steps (``mode.OptimizerHooks``), and the threads a
        previous ``train()`` closed started again."""
        self.model_card.forget()
        if not self.copies:
            return
        where = self._hooks.hook(self.trainer)
        self._copied_first = where is Where.BACKGROUND_COPIED_FIRST
        if self.mode.background:
            self.mode = Mode(where, self.mode.why)
        if self._reserved:
            self.snapshot.thread.start()
            self.executor.thread.start()

    def reserve(self) -> None:
        """Once, at the end of the first training step, on every rank: the copies a checkpoint needs, measured,
        checked against each machine's available memory and allocated (``reserve.reserve_copies``); where they cannot
        be, checkpoints go to the foreground and the memory tier is off, said in one line. The memory tier's room is
        checked then too (``memory_tier.MemoryTier.room``)."""
        if not self.copies or self._reserved:
            return
        self._reserved = True
        self.measured, why = reserve_copies(self.trainer, self.executor, self.snapshot)
        if why is not None:
            self._go_foreground(why)
            if self.memory is not None and self.memory.on:
                notice(self.memory.turn_off(why))
        elif self.memory is not None and self.memory.on:
            self._check_memory_room()


    def _check_memory_room(self) -> None:
        """The memory tier's room on every machine (its ranks' copies added up, and on several machines the previous
        machine's too: its replica), said at start in one line; off on every rank where some machine cannot hold
        it."""
        from trl_ext.process.collectives import from_every_rank

        args, memory = self.trainer.args, self.memory
        machines = memory.machines
        everyone = from_every_rank((machines.index, self.measured))
        own = sum(n for m, n in everyone if m == machines.index)
        peer = sum(n for m, n in everyone if m == (machines.index - 1) % machines.count) if memory.replicated else 0
        need = own + peer
        why = memory.room(need) if args.local_process_index == 0 else None
        why = next((w for w in from_every_rank(why) if w), None)
        if why is not None:
            notice(memory.turn_off(why))
            return
        def size(n: int) -> str:
            return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

        replica = (f", its own {size(own)} and the previous machine's replica {size(peer)}, on each of "
                   f"{machines.count} machines" if memory.replicated else "")
        notice(f"memory_checkpoint_steps={memory.steps}: a checkpoint in memory every {memory.steps} steps, in "
               f"{memory.root} ({size(need)} each on this machine{replica}, two while one is written, beside "
               f"{size(own)} of copies); resumed from when newer than the disk's.")

    def start_memory_tier(self, resumed: str | None) -> None:
        """When training starts, on every rank: the memory tier off where it cannot work here (said in one line),
        else its directory made this run's, every older memory checkpoint but ``resumed`` removed."""
        memory, args = self.memory, self.trainer.args
        if memory is None or not memory.on:
            return
        memory.know_machines(args)
        memory.share_token(args, create=True)
        why = None
        if args.push_to_hub:
            why = "push_to_hub uploads every checkpoint"
        elif self.trainer.hp_search_backend is not None:
            why = "a hyperparameter search runs"
        if why is None and args.local_process_index == 0:
            try:
                memory.begin(resumed)
            except OSError as exc:
                why = f"{memory.root} cannot be written ({exc.strerror or exc})"
        if args.world_size > 1:  # every rank takes memory checkpoints, or none does
            from trl_ext.process.collectives import from_every_rank

            why = next((w for w in from_every_rank(why) if w), None)
        if why is not None:
            notice(memory.turn_off(why))


class CheckpointCallback(TrainerCallback):
    """``Checkpoints`` at the points of Trainer's loop: ``start`` when training starts; at every step boundary, the
    first step's reserve and the outcome of a checkpoint in flight; at the end, the wait for it and ``close``."""

    def __init__(self, checkpoints: Checkpoints):
        self.checkpoints = checkpoints

    def on_train_begin(self, args, state, control, **kwargs):
        self.checkpoints.start()

    def on_step_end(self, args, state, control, **kwargs):
        self.checkpoints.reserve()
        self.checkpoints.poll()

    def on_train_end(self, args, state, control, **kwargs):
        # after Trainer's last log line: the cost is recorded (``history``), not logged
        self.checkpoints.wait_for_writes(log=False)
        self.checkpoints.close()
        self.checkpoints.end()
