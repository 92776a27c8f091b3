"""The in-memory merge: load the base once, merge in place, check that the merged model gives the adapter model's
outputs, then write it with ``save_pretrained`` into a hidden directory, audit it and commit it atomically (the model
is whole and in memory here, so transformers' own writer is the reference). For what the streamed merge
(``streamed``) refuses: a base to dequantize, LoRA on fused MoE expert tensors, DoRA."""

import shutil
from pathlib import Path

import torch

from trl_ext.data.model_paths import check_model_path
from trl_ext.errors import MergeError
from trl_ext.files.audit import audit
from trl_ext.files.commit import PARTIAL_SUFFIX, commit, sync_files
from trl_ext.merge import inputs


def merge(adapter: str, out: str, base: str | None = None, dtype: str = "auto",
          max_shard_size: int | str = "5GB", dequantize_base: bool = False) -> Path:
    """Merge ``adapter`` into its base and save a standalone model to ``out``, in memory (``trl-ext merge`` streams).

    Args:
        adapter: a PEFT adapter directory (LoRA, DoRA, ``modules_to_save`` heads included).
        out: the directory for the merged model; it must not exist or be empty.
        base: the base model id or path; default: the one the adapter records.
        dtype: the merged model's dtype (``"auto"``: the base's).
        max_shard_size: the largest safetensors file written.
        dequantize_base: merge into a dequantized copy of a quantized base instead of refusing it.

    Returns:
        The output directory.

    Raises:
        MergeError: the output exists, the base is unknown or quantized, or the adapter is damaged or does not fit
            the base; nothing was written.
    """
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    adapter_dir, out_dir = Path(adapter), Path(out)
    inputs.check_out_dir(out_dir)
    config = inputs.adapter_config(adapter_dir)
    base = inputs.base_name(config, base)
    check_model_path(base)
    inputs.refuse_quantized(base, transformers.AutoConfig.from_pretrained(base), dequantize_base)
    num_labels = inputs.head_outputs(adapter_dir, config)
    is_classifier = num_labels is not None
    inputs.audit_adapter(adapter_dir, base, num_labels)

    tokenizer_source = adapter_dir if (adapter_dir / "tokenizer_config.json").exists() else base
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    kwargs = {"dtype": dtype}
    if is_classifier:
        model_class, kwargs["num_labels"] = AutoModelForSequenceClassification, num_labels
    else:  # the class the adapter was trained on, as PEFT records it (a vision-language model is no causal LM)
        recorded_class = (config.get("auto_mapping") or {}).get("base_model_class")
        model_class = getattr(transformers, recorded_class or "", None) or AutoModelForCausalLM
    model = model_class.from_pretrained(base, **kwargs)
    if dequantize_base and getattr(model, "is_quantized", False):
        model = model.dequantize()
    if is_classifier and model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id  # batched rewards need it to find each last token
    model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()

    probe = inputs.probe_ids(model.get_base_model().config)
    with torch.no_grad():
        expected = model(input_ids=probe, attention_mask=torch.ones_like(probe)).logits
        merged = model.merge_and_unload()  # in place: never a second copy of the weights
        got = merged(input_ids=probe, attention_mask=torch.ones_like(probe)).logits
    inputs.check_outputs(got, expected, merged.dtype)
    _write(merged, tokenizer, out_dir, max_shard_size, num_labels)
    return out_dir


def _write(model, tokenizer, out: Path, max_shard_size, num_labels: int | None) -> None:
    """``save_pretrained`` into a hidden directory beside ``out``, synced, audited, then renamed into place."""
    target = out.absolute()
    partial = target.with_name(f".{target.name}{PARTIAL_SUFFIX}")
    shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted merge
    try:
        model.save_pretrained(partial, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(partial)
        sync_files(partial)
        report = audit(str(partial), num_labels=num_labels or 1)
        if not report.ok:
            raise MergeError(f"the merged model failed verification; nothing was written:\n{report.format()}")
        commit(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
