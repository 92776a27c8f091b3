"""A ZeRO checkpoint resumed on another number of processes, through DeepSpeed's universal checkpoint.

A ZeRO checkpoint holds one optimizer partition per data-parallel rank, so DeepSpeed can only load it on the world
size that wrote it. When that changed, the checkpoint is converted once to DeepSpeed's universal checkpoint
(``deepspeed.checkpoint.ds_to_universal``, written beside the original in the checkpoint directory) and loaded with
``load_universal``. DeepSpeed's ZeRO-3 loader of it needs a repair after it ran (patch ``zero3-universal-load``):
``repair_after_load``.
"""

import contextlib
import io
import os
import shutil
import tempfile
from pathlib import Path

from trl_ext import patches
from trl_ext.resuming.world_size import Reshard, keep_global_batch

UNIVERSAL_SUFFIX = "_universal"


def folder(checkpoint: str | os.PathLike, tag: str) -> Path:
    """Where ``convert_to_universal`` writes the universal checkpoint of ``checkpoint/tag``."""
    return Path(checkpoint) / f"{tag}{UNIVERSAL_SUFFIX}"


def convert_to_universal(checkpoint: str | os.PathLike, tag: str) -> None:
    """Write DeepSpeed's universal checkpoint of ``checkpoint/tag`` to ``checkpoint/tag_universal`` (once; atomic).

    Args:
        checkpoint: the ``checkpoint-N`` directory.
        tag: its DeepSpeed tag (``global_stepN``).
    """
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    checkpoint = Path(checkpoint)
    final = folder(checkpoint, tag)
    if not final.is_dir():
        partial = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=checkpoint))
        options = Namespace(input_folder=str(checkpoint / tag), output_folder=str(partial), num_extract_workers=1,
                            num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # its progress report is per parameter
                ds_to_universal.main(options)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        partial.chmod(0o755)
        os.replace(partial, final)
    # What load_universal reads instead of ``latest``. Always rewritten: ds_to_universal writes one naming its
    # output folder, here the partial directory.
    tmp = checkpoint / f".latest_universal.{os.getpid()}"
    tmp.write_text(final.name)
    os.replace(tmp, checkpoint / "latest_universal")


def apply(reshard: Reshard, args, deepspeed_config: dict) -> str | None:
    """Set the resumed run's gradient accumulation (and DeepSpeed's batch sizes) to keep the global batch size, and
    ask DeepSpeed for the universal checkpoint when the world size changed.

    Args:
        reshard: from ``world_size.read_reshard``.
        args: the resumed run's ``TrainingArguments`` (changed in place).
        deepspeed_config: the DeepSpeed config the engine will be built from (changed in place).

    Returns:
        The one-line notice to print, or None when nothing changed.
    """
    notice = keep_global_batch(reshard, args)
    deepspeed_config["gradient_accumulation_steps"] = reshard.gradient_accumulation_steps
    deepspeed_config["train_batch_size"] = reshard.global_batch_size
    if reshard.changed:
        deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    return notice


def repair_after_load(engine, checkpoint: str | os.PathLike, reshard: Reshard) -> bool:
    """After DeepSpeed's engine loaded the universal checkpoint of ``checkpoint`` under ZeRO-3: each sub-group of the
    optimizer gets its own Adam step count and each parameter group its own saved hyperparameters (DeepSpeed's loader
    shares one step tensor, so the step advances once per sub-group, and gives every group the first group's
    hyperparameters; patch ``zero3-universal-load``).

    Args:
        engine: the DeepSpeed engine that loaded it (``Trainer.model_wrapped``).
        checkpoint: the ``checkpoint-N`` directory.
        reshard: from ``world_size.read_reshard``; nothing to repair unless the world size changed.

    Returns:
        Whether the optimizer was repaired (False: not a universal load, not ZeRO-3, or the release moved).
    """
    if not reshard.changed or reshard.tag is None:
        return False
    return repair_zero3_universal_load(engine.optimizer, folder(checkpoint, reshard.tag) / "zero")


def repair_zero3_universal_load(zero_optimizer, universal_zero_dir) -> bool:
    """After DeepSpeed's ZeRO-3 optimizer loaded a universal checkpoint: each sub-group its own Adam step count, each
    parameter group its own saved hyperparameters (patch ``zero3-universal-load``).

    Args:
        zero_optimizer: the engine's optimizer (``engine.optimizer``); only ZeRO-3's is repaired.
        universal_zero_dir: the universal checkpoint's ``zero`` folder (its ``optimizer_state.pt``).

    Returns:
        Whether it was repaired.
    """
    import torch
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if not isinstance(zero_optimizer, DeepSpeedZeroOptimizer_Stage3) or not patches.applies("zero3-universal-load"):
        return False
    base = zero_optimizer.optimizer
    for flat in zero_optimizer.fp32_partitioned_groups_flat:
        state = base.state.get(flat, {})
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    # mmap: only the parameter groups are read, not the partition of the states the file also holds
    saved = torch.load(f"{universal_zero_dir}/optimizer_state.pt", map_location="cpu", weights_only=False, mmap=True)
    groups = saved["optimizer_state_dict"]["param_groups"]
    if len(groups) == len(base.param_groups):  # the same trainer builds the same groups, in the same order
        for group, saved_group in zip(base.param_groups, groups):
            group.update({key: value for key, value in saved_group.items() if key != "params"})
    return True
