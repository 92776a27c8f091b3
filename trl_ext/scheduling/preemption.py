"""Preemption: SIGTERM or SIGUSR1 on any rank stops every rank at the next step boundary, with a checkpoint.

Schedulers stop a job by signalling it, then kill it after a grace period: Kubernetes sends SIGTERM, SLURM sends
SIGTERM (or, with ``--signal=USR1@<seconds>``, SIGUSR1 first). A signal may reach only some ranks. Saving from the
signal handler, as transformers' ``enable_jit_checkpoint`` does on each rank by itself, would start a collective save
on those ranks while the others keep training: a hang. Here the handler only records the signal; at each step
boundary all ranks agree (one all-reduce of one number), and if any rank was signalled every rank saves the
checkpoint of that step through the one save path, then exits with ``128 + signal`` (143 for SIGTERM, 138 for
SIGUSR1), the code a process killed by that signal reports, so a scheduler that requeues a preempted job does so.
"""

import signal
import sys
import threading

import torch
from transformers import TrainerCallback

from trl_ext.process import notice

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def wanted(args) -> bool:
    """Whether this run stops with a checkpoint on SIGTERM or SIGUSR1: ``save_on_preemption`` (trl_ext's configs,
    default True) or transformers' ``enable_jit_checkpoint``, which this replaces."""
    return bool(getattr(args, "save_on_preemption", True) or getattr(args, "enable_jit_checkpoint", False))


def exit_code(signum: int) -> int:
    """The exit code after a preemption: the one a process killed by ``signum`` reports (143 for SIGTERM)."""
    return 128 + signum


def replace_jit_checkpoint(trainer) -> None:
    """Remove transformers' ``JITCheckpointCallback`` (``enable_jit_checkpoint``) and put back the SIGTERM handler it
    replaced: ``Preemption`` saves instead, once, on every rank together, so the two never both save."""
    for callback in list(trainer.callback_handler.callbacks):
        if type(callback).__name__ == "JITCheckpointCallback":
            original = getattr(getattr(callback, "jit_manager", None), "_original_sigterm_handler", None)
            if original is not None:
                signal.signal(signal.SIGTERM, original)
            trainer.remove_callback(callback)


class Preemption(TrainerCallback):
    """Records SIGTERM and SIGUSR1 during training; at each step boundary every rank learns whether any rank got one;
    then the step's checkpoint is saved and every rank exits. ``restore`` gives the signals back their handlers (the
    trainer calls it when ``train`` ends, unless it ends in this exit)."""

    def __init__(self):
        self.received = 0  # the first signal this rank got
        self.stopping = 0  # the signal all ranks agreed on
        self.previous = {}
        self.before_exit = None  # called on every rank before the exit: a background save in flight is committed

    def on_train_begin(self, args, state, control, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            notice("Training runs outside the main thread: SIGTERM and SIGUSR1 cannot be caught, so a preempted job "
                   "stops without a checkpoint.")
            return
        for signum in SIGNALS:
            self.previous[signum] = signal.signal(signum, self._record)

    def _record(self, signum, frame):
        self.received = self.received or signum  # nothing else here: the step boundary acts on it

    def _agreed(self, args) -> int:
        """The signal any rank received (0 if none), on every rank: a collective, at the same point on all ranks."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int64, device=args.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item())

    def on_step_end(self, args, state, control, **kwargs):
        self.stopping = self._agreed(args)
        if self.stopping:  # Trainer saves this step's checkpoint right after, then on_save below exits
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        if not self.stopping:  # a signal during this save: it is committed now, so stop here
            self.stopping = self._agreed(args)
        if self.stopping:
            self._exit(args, state)

    def _exit(self, args, state):
        if self.before_exit is not None:
            self.before_exit()
        name = signal.Signals(self.stopping).name
        checkpoint = f"{args.output_dir.rstrip('/')}/checkpoint-{state.global_step}"
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
