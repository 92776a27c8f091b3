"""The one front end of ``trl-ext merge``: which merge runs (streamed, or in memory where it must be), said in one
line. Both merges share their checks through ``inputs``."""

import json
from pathlib import Path

from trl_ext.merge.in_memory import merge
from trl_ext.merge.streamed import MergeReport, merge_streamed


def in_memory_reason(adapter: str, dequantize_base: bool) -> str | None:
    """Why this adapter is merged in memory rather than streamed, or None to stream it.

    Args:
        adapter: the adapter directory.
        dequantize_base: whether the user asked to dequantize a quantized base.

    Returns:
        One line for the user, or None.
    """
    if dequantize_base:  # a quantized base has to be loaded and dequantized
        return "--dequantize-base: merging in memory (the base is loaded and dequantized)"
    try:
        config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None  # an unreadable config is the merge's to report
    if config.get("target_parameters"):  # its deltas land on tensors the checkpoint splits (one per expert)
        return ("LoRA on parameters (PEFT target_parameters, fused MoE experts): merging in memory, where "
                "transformers converts the merged experts back to the checkpoint's per-expert tensors")
    return None


def merge_adapter(adapter: str, out: str, base: str | None = None, dtype: str = "auto",
                  max_shard_size: int | str = "5GB", dequantize_base: bool = False,
                  say=print) -> tuple[Path, MergeReport | None]:
    """Merge ``adapter`` into its base and save a standalone model: streamed tensor by tensor, or in memory where
    ``in_memory_reason`` says so.

    Args:
        adapter: the adapter directory.
        out: the output directory (must not hold files).
        base: the base model id or path; default: the one the adapter records.
        dtype: ``auto`` or a floating dtype name for the merged tensors.
        max_shard_size: the largest safetensors file.
        dequantize_base: allow a quantized base (merged in memory after dequantizing it).
        say: where the one line on the choice goes.

    Returns:
        The output directory, and the streamed merge's report (None for the in-memory merge).

    Raises:
        errors.MergeError: anything either merge refuses, before anything is written, or a failed check.
    """
    reason = in_memory_reason(adapter, dequantize_base)
    if reason:
        say(reason)
        return merge(adapter, out, base=base, dtype=dtype, max_shard_size=max_shard_size,
                     dequantize_base=dequantize_base), None
    report = merge_streamed(adapter, out, base=base, dtype=dtype, max_shard_size=max_shard_size)
    return report.path, report
