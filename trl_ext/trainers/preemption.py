"""Preemption: SIGTERM or SIGUSR1 on any rank stops every rank at a step boundary, with a checkpoint.

Schedulers stop a job by signalling it, then kill it after a grace period: Kubernetes sends SIGTERM, SLURM sends
SIGTERM (or, with ``--signal=USR1@<seconds>``, SIGUSR1 first). A signal may reach only some ranks. Saving from the
signal handler, as transformers' ``enable_jit_checkpoint`` does on each rank by itself, would start a collective save
on those ranks while the others keep training: a hang. Here the handler only records the signal; at each step
boundary all ranks agree (one all-reduce of one number), and if any rank was signalled every rank saves the
checkpoint of that step through the one save path, then exits with ``128 + signal`` (143 for SIGTERM, 138 for
SIGUSR1), the code a process killed by that signal reports, so a scheduler that requeues a preempted job does so.

Under Slurm, SIGUSR1 is the time-limit warning, and it says how much time is left: the ranks train on until the time
left comes down to what the stop needs, measured on this run (``deadline``), and a warning that comes while a
checkpoint is written is acted on once it is committed. On a Slurm node (``launching.node``) a planned stop ends
quietly: each rank leaves what it saved for its node's launcher (``outcome``) and exits with 0, so that torchrun
prints no traceback for it; the launcher reports the node's stop, with 138 or 143, in one line.
"""

import os
import signal
import sys
import threading
import time

from transformers import TrainerCallback

from trl_ext import patches
from trl_ext.placement import failure_limit, outcome, ownership
from trl_ext.process import HOSTED, decided_on_rank0, end_together, max_over_ranks, notice
from trl_ext.settings.trainer_options import SaveOptions
from trl_ext.trainers import deadline

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
REASK_SECONDS = 10.0  # once warned, rank 0 asks Slurm for the time left this often (the limit may change)


def wanted(args) -> bool:
    """Whether this run stops with a checkpoint on SIGTERM or SIGUSR1: ``save_on_preemption`` (trl_ext's configs,
    default True) or transformers' ``enable_jit_checkpoint``, which this replaces."""
    return bool(SaveOptions.of(args).save_on_preemption or getattr(args, "enable_jit_checkpoint", False))


def exit_code(signum: int) -> int:
    """The exit code after a preemption: the one a process killed by ``signum`` reports (143 for SIGTERM)."""
    return 128 + signum


def replace_jit_checkpoint(trainer) -> None:
    """Remove transformers' ``JITCheckpointCallback`` (``enable_jit_checkpoint``) and put back the SIGTERM handler it
    replaced: ``Preemption`` saves instead, once, on every rank together, so the two never both save."""
    for callback in list(trainer.callback_handler.callbacks):
        if type(callback).__name__ == "JITCheckpointCallback":
            original = jit_checkpoint_sigterm_handler(callback)
            if original is not None:
                signal.signal(signal.SIGTERM, original)
            trainer.remove_callback(callback)


class Preemption(TrainerCallback):
    """Records SIGTERM and SIGUSR1 during training; at each step boundary every rank learns whether any rank got one;
    then the step's checkpoint is saved and every rank exits (for the time-limit warning under Slurm: once the time
    left requires it). ``restore`` gives the signals back their handlers (the trainer calls it when ``train`` ends,
    unless it ends in this exit).

    Args:
        checkpoints: the trainer's ``saving.checkpoints.Checkpoints``, or None: a background checkpoint's write time
            counts in what a stop needs.
    """

    def __init__(self, checkpoints=None):
        self.received = 0  # the strongest signal this rank got (SIGTERM over SIGUSR1)
        self.reason = None  # a stop asked for by the orchestrator's side of trl_ext, said in the stop's line
        self.stopping = 0  # the signal all ranks agreed to stop on
        self.previous = {}
        self.before_exit = None  # called on every rank before the exit: a background save in flight is committed
        self.checkpoints = checkpoints
        self.budget = deadline.Budget()
        self._mark = None  # when the last step, log, evaluation or save ended
        self._deadline = None  # rank 0, once warned under Slurm: the clock's reading at the time limit
        self._asked = 0.0  # when rank 0 last asked Slurm for the time left
        self._going_on_said = False
        self._clock = time.monotonic
        outcome.watch()  # on a Slurm node: an error that ends this rank is told apart from a lost peer

    def request_stop(self, reason: str) -> None:
        """Stop every rank at the next step boundary with a checkpoint, as SIGTERM would, for ``reason`` (said in the
        stop's line instead of the signal): a planned restart (``trl_ext.ray``: a node joined, the group grows).

        Args:
            reason: why, in a few words.
        """
        self.reason = reason
        self.received = max(self.received, signal.SIGTERM)

    def on_train_begin(self, args, state, control, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            if not os.environ.get(HOSTED):  # a Ray Train worker's thread: Ray signals nothing, it ends the worker
                notice("Training runs outside the main thread: SIGTERM and SIGUSR1 cannot be caught, so a preempted "
                       "job stops without a checkpoint.")
            return
        for signum in SIGNALS:
            self.previous[signum] = signal.signal(signum, self._record)
        known = ownership.record(args.output_dir) if ownership.is_own(args.output_dir) else {}
        self.budget = deadline.Budget(known.get("save_seconds"), known.get("step_seconds"))  # an earlier run's
        self._mark = self._clock()

    def _record(self, signum, frame):
        self.received = max(self.received, signum)  # nothing else here: the step boundary acts on it

    def _agreed(self, args) -> int:
        """The strongest signal any rank received (0 if none), on every rank: a collective, at the same point on all
        ranks."""
        return max_over_ranks(self.received, args.device)

    def _decide(self, args, state) -> int:
        """The signal every rank stops on now, or 0 to go on: SIGTERM at once; the time-limit warning once rank 0 finds
        the time left within what a stop needs (collective)."""
        agreed = self._agreed(args)
        if agreed != signal.SIGUSR1:
            return agreed
        if getattr(state, "max_steps", 0) and state.global_step >= state.max_steps:
            return 0  # the last step: training ends here anyway, and the warning changes nothing
        return agreed if decided_on_rank0(lambda: self._due(state)) else 0

    def _due(self, state) -> bool:
        """Rank 0: whether the warned run must stop now."""
        from trl_ext.placement.orchestrators import slurm  # the time-limit warning's timing is Slurm's

        job_id = slurm.job_id()
        if job_id is None:
            return True  # nothing says how much time is left: stop now
        now = self._clock()
        if self._deadline is None or now - self._asked >= REASK_SECONDS:
            left = deadline.time_left(job_id)
            self._asked = now
            self._deadline = None if left is None else now + left
            if left is None:
                return True
        left = self._deadline - now
        if self.budget.must_stop(left):
            return True
        if not self._going_on_said:
            self._going_on_said = True
            notice(f"time-limit warning at step {state.global_step}: {left:.0f} s left; a step and a checkpoint take "
                   f"{self.budget.need:.1f} s here, so training goes on until {self.budget.threshold():.0f} s are left")
        return False

    def on_step_end(self, args, state, control, **kwargs):
        now = self._clock()
        if self._mark is not None:
            self.budget.step(now - self._mark)
        self._mark = now
        self.stopping = self._decide(args, state)
        if self.stopping:  # Trainer saves this step's checkpoint right after, then on_save below exits
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, **kwargs):
        self._mark = self._clock()  # a save's time starts after the step's log and evaluation

    def on_evaluate(self, args, state, control, **kwargs):
        self._mark = self._clock()

    def on_save(self, args, state, control, **kwargs):
        self._measure_save(args)
        if not self.stopping:  # a signal during this save: it is committed now, so stop here if it is time
            self.stopping = self._decide(args, state)
        if self.stopping:
            self._exit(args, state)

    def _measure_save(self, args) -> None:
        """The checkpoint just saved: its time (a background save's write counted twice), kept in the job's record."""
        if self._mark is None:
            return
        now = self._clock()
        seconds, self._mark = now - self._mark, now
        last = self.checkpoints.last if self.checkpoints is not None else None  # the last background checkpoint
        written = last.cost.write_s if last is not None else None
        self.budget.save(seconds + 2 * written if written is not None else seconds)
        if getattr(args, "process_index", 0) == 0 and ownership.is_own(args.output_dir):
            ownership.update(args.output_dir, save_seconds=round(self.budget.save_seconds, 3),
                             step_seconds=round(self.budget.step_seconds, 3))

    def _exit(self, args, state):
        if self.before_exit is not None:
            self.before_exit()
        name = signal.Signals(self.stopping).name
        checkpoint = f"{args.output_dir.rstrip('/')}/checkpoint-{state.global_step}"
        if getattr(args, "process_index", 0) == 0:
            failure_limit.stopped(args.output_dir)  # a planned stop: the next attempt does not count it as a failure
        if self.reason is not None:
            notice(f"{self.reason}: saved {checkpoint} (step {state.global_step}) and stopped")
            sys.exit(exit_code(self.stopping))
        if outcome.stopped(name, state.global_step, checkpoint):  # a Slurm node: its launcher says it, with the code
            end_together()  # every rank has stopped at this step; without a gloo teardown at exit (see process)
            sys.exit(0)
        notice(f"{name} received: saved {checkpoint} (step {state.global_step}) and stopped, exit code "
               f"{exit_code(self.stopping)}. To continue, run the same command with resume_from_checkpoint=True "
               f"(recipes: --resume_from_checkpoint true).")
        # The handlers stay: the launcher (torchrun) sends SIGTERM to the ranks still running once one has exited,
        # and each rank must finish its own exit, with this code, rather than die of it.
        sys.exit(exit_code(self.stopping))

    def on_train_end(self, args, state, control, **kwargs):
        self.restore()

    def restore(self):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}


def jit_checkpoint_sigterm_handler(callback):
    """The SIGTERM handler transformers' ``JITCheckpointCallback`` replaced (patch
    ``jit-checkpoint-sigterm-handler``), or None (none replaced, or the release moved it)."""
    manager = getattr(callback, "jit_manager", None)
    if manager is None or not patches.applies("jit-checkpoint-sigterm-handler"):
        return None
    return getattr(manager, "_original_sigterm_handler", None)
