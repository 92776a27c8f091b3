"""Environment fixes so one script and one config run on GPU machines and on CPU-only machines alike.

Each fix changes a setting only where the hardware cannot honour it, and says so in one line. On a GPU machine
nothing changes.
"""

import contextlib
import copy
import dataclasses
import functools
import json
import os
import tempfile
from pathlib import Path

import torch
from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

from trl_ext import patches
from trl_ext.engines import fsdp
from trl_ext.errors import ConfigError, SetupError
from trl_ext.process.notices import notice
from trl_ext.process.ranks import env_world_size


def has_accelerator() -> bool:
    return torch.cuda.is_available() or is_torch_xla_available() or (
        hasattr(torch, "xpu") and torch.xpu.is_available()
    )


def is_distributed_launch() -> bool:
    """True under torchrun / accelerate launch with more than one process."""
    return env_world_size() > 1


def adapt_to_hardware(args) -> None:
    """Fix a TrainingArguments-like object *before* its ``__post_init__`` validates it.

    - bf16/fp16 requested where the hardware cannot run them -> fp32. TRL's configs default to bf16, which fails on
      CPU with "Your setup doesn't support bf16/gpu".
    - No accelerator -> no pinned memory for the dataloader (there is nothing to copy to).
    - A multi-process launch without a GPU -> the gloo backend, and (without DeepSpeed) accelerate's CPU mode. Without
      them accelerate finds no backend, or sets up no data parallelism, and each process trains alone.
    """
    if args.bf16 and args.fp16:  # both asked for explicitly (TRL's bf16 default is None); on CPU both would vanish
        raise ConfigError("bf16=True and fp16=True conflict: pass only one of --bf16 / --fp16 (neither: fp32)")
    if args.use_cpu:
        return  # the user asked for CPU explicitly; transformers handles that path itself
    unsupported = set()
    if not is_torch_bf16_gpu_available() and not is_torch_xla_available():
        unsupported |= {"bf16", "fp8"}  # accelerate's fp8 runs on bf16 autocast
    if not has_accelerator():
        unsupported.add("fp16")
    changed = []
    bf16_requested = args.bf16 is None or args.bf16 or args.bf16_full_eval  # TRL resolves None to True
    if bf16_requested and not args.fp16 and "bf16" in unsupported:
        args.bf16, args.bf16_full_eval = False, False
        changed.append("bf16 (training arguments)")
    if (args.fp16 or args.fp16_full_eval) and "fp16" in unsupported:
        args.fp16, args.fp16_full_eval = False, False
        changed.append("fp16 (training arguments)")
    # The same choice can come from the accelerate config and from a DeepSpeed config; all must agree with the
    # arguments, or transformers stops in deepspeed_init ("ds bf16.enabled=True vs hf bf16=False").
    changed += _disable_in_launcher_configs(args, unsupported)
    if changed:
        why = ("no bf16-capable GPU" if "fp16" not in " ".join(changed) else "no GPU")
        notice(f"{' and '.join(dict.fromkeys(c.split(' ')[0] for c in changed))} is not supported on this hardware "
               f"({why}): training in fp32 instead (turned off: {', '.join(changed)}).")
    if not has_accelerator() and getattr(args, "dataloader_pin_memory", False):
        args.dataloader_pin_memory = False  # nothing to pin for; torch warns once per dataloader (24 lines a run)
    if is_distributed_launch() and not has_accelerator():
        if args.ddp_backend is None:
            args.ddp_backend = "gloo"
            notice("multi-process launch without a GPU: using the gloo backend (CPU).")
        if not uses_deepspeed(args):
            # Without a GPU, accelerate sets up data parallelism only when told it runs on CPU (MULTI_CPU); otherwise
            # every rank trains alone on all the data. Under DeepSpeed this must stay unset: transformers would skip it.
            os.environ["ACCELERATE_USE_CPU"] = "true"


def fsdp_on_cpu(args):
    """Context for the trainer's constructor (which builds accelerate's state once): a multi-process FSDP launch
    without a GPU runs FSDP on CPU processes with gloo, as DeepSpeed does, instead of unsharded data parallelism."""
    if fsdp.requested(args) and is_distributed_launch() and not has_accelerator():
        return accelerate_fsdp_on_cpu()
    return contextlib.nullcontext()


def _disable_in_launcher_configs(args, unsupported: set[str]) -> list[str]:
    """Turn off ``unsupported`` precisions in accelerate's ``mixed_precision`` and in the DeepSpeed config (a dict, a
    JSON file in the arguments, or accelerate's ``deepspeed_config_file``); "auto" follows the arguments already."""
    changed = []
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if launcher in unsupported:
        os.environ["ACCELERATE_MIXED_PRECISION"] = "no"
        changed.append(f"{launcher} (accelerate mixed_precision)")
    env_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") if uses_deepspeed(args) else None
    source = args.deepspeed or env_file
    if not source:
        return changed
    config = json.loads(Path(source).read_text()) if isinstance(source, (str, os.PathLike)) else copy.deepcopy(source)
    for section, mode in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        block = config.get(section)
        if mode in unsupported and isinstance(block, dict) and str(block.get("enabled")).lower() == "true":
            block["enabled"] = False
            changed.append(f"{mode} (DeepSpeed {section}.enabled)")
    if not any("DeepSpeed" in c for c in changed):
        return changed
    if args.deepspeed:
        args.deepspeed = config
    else:  # accelerate hands transformers a file: give it an adjusted copy
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="trl_ext-ds-", delete=False) as f:
            json.dump(config, f)
        os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = f.name
    return changed


def uses_deepspeed(args) -> bool:
    return bool(args.deepspeed) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def check_distributed_setup(args) -> None:
    """Fail early, with the fix, when a launch with several processes ended up with one training process."""
    from transformers.training_args import ParallelMode

    world = env_world_size()
    if world > 1 and (args.world_size == 1 or args.parallel_mode != ParallelMode.DISTRIBUTED):
        raise SetupError(
            f"This script was launched with {world} processes, but each one set up training alone (world size "
            f"{args.world_size}, parallel mode {args.parallel_mode.value}). "
            "On a machine without a GPU, pass ddp_backend='gloo' or build the config from trl_ext "
            "(`from trl_ext import DPOConfig`), which sets it for you."
        )


def check_offloading_has_an_accelerator(args) -> None:
    """Refuse TRL's activation offloading without an accelerator, in one line, before the model loads: it moves
    activations with a CUDA/XPU device's streams. TRL fails too, later: on a CPU build of torch with one line, on a CUDA
    build without a driver (torch from PyPI on a CPU machine) with CUDA's multi-line error.

    Args:
        args: the training config (``activation_offloading``, TRL's SFT and DPO configs).

    Raises:
        errors.SetupError: ``activation_offloading=True`` on a machine without an accelerator, or with ``use_cpu``.
    """
    if getattr(args, "activation_offloading", False) and (getattr(args, "use_cpu", False) or not has_accelerator()):
        raise SetupError("activation_offloading=True needs a GPU: TRL's activation offloading moves activations with "
                         "a CUDA or XPU device's streams, and this run has none. Set activation_offloading=False "
                         "(--activation_offloading false), or train on a GPU.")


def accelerate_fsdp_on_cpu():
    """Context: accelerate chooses FSDP for a multi-process CPU launch (MULTI_CPU) with an FSDP plugin, as it does on
    GPUs (patch ``fsdp-on-cpu``). Around the trainer's constructor, which builds the accelerator state once."""
    from accelerate.state import AcceleratorState, DistributedType, PartialState

    original = AcceleratorState.__dict__["__init__"]

    @functools.wraps(original)
    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = self.distributed_type  # as accelerate does at the end
            self.fsdp_plugin = fsdp_plugin
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            if getattr(fsdp_plugin.cpu_offload, "pin_memory", False):  # pinned memory needs an accelerator
                fsdp_plugin.cpu_offload = dataclasses.replace(fsdp_plugin.cpu_offload, pin_memory=False)

    return patches.swapped("fsdp-on-cpu", AcceleratorState, "__init__", __init__)
