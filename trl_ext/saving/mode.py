"""Where a trainer's checkpoints are written, and why (``Mode``): in the foreground (written before training goes on) or
in the background (written on the executor's thread while training goes on).

A run starts in the mode it asks for (``save_in_background``). A background run waits for each checkpoint's copies
before the next step of the torch optimizers that change what was copied (``OptimizerHooks``); with no such optimizer
to hook, the copies end before each checkpoint returns. It goes to the foreground for good, said in one line, where
the background cannot work: copies that would not fit in memory, parts that cannot be copied, ``push_to_hub``.
"""

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trl_ext.placement.orchestrators import torchrun
from trl_ext.process.notices import notice
from trl_ext.settings.trainer_options import SaveOptions

CPU_COST = ("the copies and writes of each checkpoint run on the cores training uses, so they slow the steps after "
            "it: on 2 cores, runs with background checkpoints took {ratio} the time of the same runs with foreground "
            "ones (docs/saving.md#on-a-cpu)")


class Where(enum.Enum):
    FOREGROUND = "foreground"  # each checkpoint written before training goes on
    BACKGROUND = "background"  # written meanwhile; its copies end before the next optimizer step
    BACKGROUND_COPIED_FIRST = "background, copied first"  # written meanwhile; its copies end before it returns


@dataclass(frozen=True)
class Mode:
    """Where checkpoints are written, and why.

    Args:
        where: foreground or background (``Where``).
        why: the reason, said to the user when a run that asked for the background goes to the foreground.
    """

    where: Where
    why: str

    @property
    def background(self) -> bool:
        return self.where is not Where.FOREGROUND

    @classmethod
    def asked(cls, args) -> "Mode":
        """The mode the training arguments ask for."""
        if SaveOptions.of(args).save_in_background:
            return cls(Where.BACKGROUND, "save_in_background is set")
        return cls(Where.FOREGROUND, "save_in_background is not set")

    def foreground(self, why: str) -> "Mode":
        """The foreground from now on, said once (by the mode that was in the background)."""
        if self.background:
            notice(f"save_in_background: checkpoints are saved in the foreground, because {why}.")
            return Mode(Where.FOREGROUND, why)
        return self


def torch_optimizers(trainer) -> list[torch.optim.Optimizer]:
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


class OptimizerHooks:
    """``wait()`` before every step of the torch optimizers that change the originals, each optimizer hooked once (a
    later ``train()`` may bring a new one).

    Args:
        wait: the wait for a checkpoint's copies (looked up at each step: tests replace it).
    """

    def __init__(self, wait: Callable[[], None]):
        self.wait = wait
        self.hooked: list[torch.optim.Optimizer] = []

    def hook(self, trainer) -> Where:
        """Hook the trainer's optimizers.

        Returns:
            ``Where.BACKGROUND``, or ``Where.BACKGROUND_COPIED_FIRST`` where there is no torch optimizer to hook (an
            optimizer of another kind: the copies must then end before each checkpoint returns).
        """
        optimizers = torch_optimizers(trainer)
        for optimizer in optimizers:
            if all(optimizer is not hooked for hooked in self.hooked):
                optimizer.register_step_pre_hook(lambda *args: self.wait())
                self.hooked.append(optimizer)
        return Where.BACKGROUND if optimizers else Where.BACKGROUND_COPIED_FIRST


def say_cpu_cost(device: torch.device, label: str = "save_in_background") -> None:
    """On a CPU-only machine whose cores the run's processes all use: what background checkpoints cost there (the
    option that asked for them: ``label``)."""
    if device.type != "cpu":
        return
    local = torchrun.local_world_size() or 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if local * torch.get_num_threads() >= cores:
        notice(f"{label} on a CPU ({local} training process(es) x {torch.get_num_threads()} "
               f"thread(s) on {cores} cores): {CPU_COST.format(ratio='0.77-1.14x')}.")
