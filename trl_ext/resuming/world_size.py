"""A checkpoint resumed on another number of processes keeps its global batch: gradient accumulation changes instead.

With the same per-device batch, the optimizer steps then see the same samples in the same order (the sampler's
permutation does not depend on the number of processes), so the data continues at the next unseen sample and the LR
schedule at the next step. The saved number of processes is read from DeepSpeed's config (ZeRO checkpoints) or from
the Trainer's own files (FSDP2, DDP, one process).
"""

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from trl_ext.errors import ResumeError

_OPTIM_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


@dataclass(frozen=True)
class Reshard:
    """How a checkpoint written on ``saved_world_size`` processes resumes on the current ones."""

    saved_world_size: int
    world_size: int
    global_batch_size: int
    gradient_accumulation_steps: int
    tag: str | None  # the checkpoint's DeepSpeed tag (``global_stepN``); None without DeepSpeed state

    @property
    def changed(self) -> bool:
        return self.saved_world_size != self.world_size


def deepspeed_tag(checkpoint: str | os.PathLike) -> str | None:
    """The DeepSpeed tag of ``checkpoint`` (from its ``latest`` file), or None if it holds no DeepSpeed state."""
    latest = Path(checkpoint) / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def read_reshard(checkpoint: str | os.PathLike, args) -> Reshard | None:
    """What it takes to resume ``checkpoint`` with training arguments ``args`` (None: not a ZeRO checkpoint).

    Args:
        checkpoint: a ``checkpoint-N`` directory written by the Trainer under DeepSpeed.
        args: the resumed run's ``TrainingArguments``.

    Returns:
        The reshard. Raises ``ResumeError`` (one line) when the global batch cannot be kept (with the arithmetic), or
        when the checkpoint lacks some ranks' states and the number of processes changed.
    """
    tag = deepspeed_tag(checkpoint)
    if tag is None:
        return None
    folder = Path(checkpoint) / tag
    ranks = {int(m.group(1)) for p in folder.iterdir() if (m := _OPTIM_FILE.search(p.name))}
    if not ranks:
        return None
    model_states = sorted(folder.glob("*model_states.pt"))[0]
    # mmap: the ds_config is all we need; ZeRO-1/2 files also hold the whole 16-bit model
    saved_config = torch.load(model_states, map_location="cpu", weights_only=False, mmap=True)["ds_config"]
    global_batch = int(saved_config["train_batch_size"])
    # From the saved batch sizes, not from the files: a node-local copy holds only its own ranks' states
    saved_world = global_batch // (int(saved_config["train_micro_batch_size_per_gpu"]) *
                                   int(saved_config["gradient_accumulation_steps"]))
    if saved_world != args.world_size and len(ranks) < saved_world:
        raise ResumeError(
            f"{folder} holds the ZeRO states of {len(ranks)} of the {saved_world} processes that saved it (node-local "
            f"storage?): resume on {saved_world} processes, or first copy every node's {tag}/ files into one "
            f"directory.")
    return _keeping_global_batch(global_batch, saved_world, args, tag)


def _keeping_global_batch(global_batch: int, saved_world: int, args, tag: str | None) -> Reshard:
    """The reshard that keeps ``global_batch`` on ``args``' processes and per-device batch, or a one-line refusal with
    the arithmetic (``ResumeError``)."""
    per_step = args.world_size * args.per_device_train_batch_size
    if global_batch % per_step:
        raise ResumeError(
            f"cannot keep the checkpoint's global batch size of {global_batch} samples (saved on {saved_world} "
            f"processes) on {args.world_size} processes x per_device_train_batch_size "
            f"{args.per_device_train_batch_size} = {per_step} samples per micro-step: {global_batch} is not a multiple "
            f"of {per_step}; resume on a number of processes (or a per-device batch) whose product divides "
            f"{global_batch}.")
    return Reshard(saved_world, args.world_size, global_batch, global_batch // per_step, tag)


def read_trainer_reshard(checkpoint: str | os.PathLike, args) -> Reshard | None:
    """``read_reshard`` for a checkpoint without DeepSpeed state (FSDP2, DDP, one process), from the Trainer's own
    files.

    The saved number of processes is the number of RNG states (``rng_state_<rank>.pth``, or one ``rng_state.pth``);
    the saved per-device batch and gradient accumulation are in ``training_args.bin``.

    Args:
        checkpoint: a ``checkpoint-N`` directory written by the Trainer.
        args: the resumed run's ``TrainingArguments``.

    Returns:
        The reshard (``tag`` None), or None when the checkpoint does not say (no RNG state or training arguments).
    """
    folder = Path(checkpoint)
    ranks = len(list(folder.glob("rng_state_*.pth"))) or (1 if (folder / "rng_state.pth").is_file() else 0)
    if not ranks or not (folder / "training_args.bin").is_file():
        return None
    try:  # the Trainer's own pickle of the arguments (trl_ext's or TRL's config classes)
        saved = torch.load(folder / "training_args.bin", map_location="cpu", weights_only=False)
        per_device, accumulation = int(saved.per_device_train_batch_size), int(saved.gradient_accumulation_steps)
    except Exception:  # noqa: BLE001 - unreadable: resume as Trainer would, with the arguments given
        return None
    return _keeping_global_batch(ranks * per_device * accumulation, ranks, args, None)


def keep_global_batch(reshard: Reshard, args) -> str | None:
    """Set ``args.gradient_accumulation_steps`` to keep the reshard's global batch size (before ``Trainer.train``).

    Returns:
        The one-line notice to print, or None when nothing changed.
    """
    if reshard.gradient_accumulation_steps == args.gradient_accumulation_steps:
        return None
    message = (f"resuming a checkpoint saved on {reshard.saved_world_size} processes on {reshard.world_size}: "
               f"gradient_accumulation_steps {args.gradient_accumulation_steps} -> "
               f"{reshard.gradient_accumulation_steps}, to keep the global batch size of {reshard.global_batch_size}.")
    args.gradient_accumulation_steps = reshard.gradient_accumulation_steps
    return message
