"""Environment fixes so one script and one config run on GPU machines and on CPU-only machines alike.

Each fix changes a setting only where the hardware cannot honour it, and says so in one line. On a GPU machine
nothing changes.
"""

import logging
import os

import torch
from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

logger = logging.getLogger("trl_ext")


def notice(message: str) -> None:
    """One-line notice, printed once per process (rank 0 only when distributed)."""
    if int(os.environ.get("RANK", "0")) == 0:
        logger.warning(f"[trl_ext] {message}")


def has_accelerator() -> bool:
    return torch.cuda.is_available() or is_torch_xla_available() or (
        hasattr(torch, "xpu") and torch.xpu.is_available()
    )


def is_distributed_launch() -> bool:
    """True under torchrun / accelerate launch with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def adapt_to_hardware(args) -> None:
    """Fix a TrainingArguments-like object *before* its ``__post_init__`` validates it.

    - bf16/fp16 requested where the hardware cannot run them -> fp32. TRL's configs default to bf16, which fails on
      CPU with "Your setup doesn't support bf16/gpu".
    - A multi-process launch without a GPU -> the gloo backend, and (without DeepSpeed) accelerate's CPU mode. Without
      them accelerate finds no backend, or sets up no data parallelism, and each process trains alone.
    """
    if args.bf16 and args.fp16:  # both asked for explicitly (TRL's bf16 default is None); on CPU both would vanish
        raise ValueError("bf16=True and fp16=True conflict: pass only one of --bf16 / --fp16 (neither: fp32)")
    if args.use_cpu:
        return  # the user asked for CPU explicitly; transformers handles that path itself
    bf16_requested = args.bf16 is None or args.bf16 or args.bf16_full_eval  # TRL resolves None to True
    if bf16_requested and not args.fp16 and not is_torch_bf16_gpu_available() and not is_torch_xla_available():
        args.bf16, args.bf16_full_eval = False, False
        notice("bf16 is not supported on this hardware (no bf16-capable GPU): training in fp32 instead.")
    if (args.fp16 or args.fp16_full_eval) and not has_accelerator():
        args.fp16, args.fp16_full_eval = False, False
        notice("fp16 needs a GPU and none was found: training in fp32 instead.")
    if is_distributed_launch() and not has_accelerator():
        if args.ddp_backend is None:
            args.ddp_backend = "gloo"
            notice("multi-process launch without a GPU: using the gloo backend (CPU).")
        if not uses_deepspeed(args):
            # Without a GPU, accelerate sets up data parallelism only when told it runs on CPU (MULTI_CPU); otherwise
            # every rank trains alone on all the data. Under DeepSpeed this must stay unset: transformers would skip it.
            os.environ["ACCELERATE_USE_CPU"] = "true"


def uses_deepspeed(args) -> bool:
    return bool(args.deepspeed) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def check_distributed_setup(args) -> None:
    """Fail early, with the fix, when a launch with several processes ended up with one training process."""
    from transformers.training_args import ParallelMode

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and (args.world_size == 1 or args.parallel_mode != ParallelMode.DISTRIBUTED):
        raise RuntimeError(
            f"This script was launched with {world} processes, but each one set up training alone (world size "
            f"{args.world_size}, parallel mode {args.parallel_mode.value}). "
            "On a machine without a GPU, pass ddp_backend='gloo' or build the config from trl_ext "
            "(`from trl_ext import DPOConfig`), which sets it for you."
        )
