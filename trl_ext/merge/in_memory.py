"""Merge a LoRA adapter into a standalone model (causal LM or reward model), and stream merged weights for serving.

- ``merge(adapter, out)``: load the base once, merge in place, check that the merged model gives the adapter model's
  outputs, then write it through trl_ext's save path (streamed shards, verified, committed atomically).
- ``iter_merged_weights(model)``: ``(name, tensor)`` of the merged weights in the Hub's own layout, one module at a
  time (gathered under ZeRO-3), without merging the model: for pushing weights into vLLM and the like.
"""

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate.utils import is_peft_model

from trl_ext.assets import resolve_model
from trl_ext.data.model_paths import check_model_path
from trl_ext.errors import MergeError
from trl_ext.saving import gather, hub_format, verify
from trl_ext.saving import pipeline as saving

PROBE_LENGTH = 16





def _adapter_config(adapter: Path) -> dict:
    path = adapter / "adapter_config.json"
    if not path.exists():
        raise MergeError(f"{adapter} is not a PEFT adapter: adapter_config.json is missing")
    return json.loads(path.read_text())


def _head_outputs(adapter: Path) -> int:
    """Outputs of the classification head saved with a SEQ_CLS adapter (1 for a reward model)."""
    from safetensors import safe_open

    with safe_open(str(adapter / verify.ADAPTER_WEIGHTS), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
            short = name.removeprefix("base_model.model.")
            if short.split(".")[0] in verify.HEAD_NAMES and short.endswith("weight") and "lora_" not in short:
                return f.get_slice(name).get_shape()[0]
    return 1


def _refuse_quantized(base: str, dequantize: bool) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    quantization = getattr(config, "quantization_config", None)
    if quantization and not dequantize:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        raise MergeError(
            f"the base {base} is a quantized checkpoint ({method}): merging into quantized weights loses the adapter's "
            "precision. Merge into the full-precision base (--base <its original model>), or pass --dequantize-base "
            "to load it and dequantize it first."
        )


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
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise MergeError(f"{out_dir} already exists and is not empty; nothing was changed. Choose a new --out.")
    config = _adapter_config(adapter_dir)
    recorded = base or config.get("base_model_name_or_path")
    if not recorded:
        raise MergeError("the adapter does not record its base model; pass --base")
    base = resolve_model(recorded)
    check_model_path(base)
    _refuse_quantized(base, dequantize_base)

    is_classifier = config.get("task_type") == "SEQ_CLS"
    num_labels = _head_outputs(adapter_dir) if is_classifier else None
    report = verify.audit(str(adapter_dir), base=base, num_labels=num_labels or 1)
    if not report.ok:
        raise MergeError("the adapter is damaged or does not fit this base model:\n" + report.format())

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

    probe = _probe(tokenizer, model.get_base_model().config)
    with torch.no_grad():
        expected = model(**probe).logits.float()
        merged = model.merge_and_unload()  # in place: never a second copy of the weights
        got = merged(**probe).logits.float()
    tolerance = 1e-4 if merged.dtype == torch.float32 else 5e-2
    if not torch.allclose(got, expected, atol=tolerance, rtol=tolerance):
        raise MergeError(f"the merged model's outputs differ from the adapter model's by "
                         f"{(got - expected).abs().max().item():.3g} (tolerance {tolerance}); nothing was written")
    saving.save(merged, str(out_dir), processing_class=tokenizer, max_shard_size=max_shard_size)
    return out_dir


def _probe(tokenizer, config) -> dict:
    """A small fixed batch of valid token ids (two rows, no padding)."""
    vocab = config.get_text_config().vocab_size  # the model's rows, whatever the tokenizer saved beside it holds
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(vocab) if i not in special][: 2 * PROBE_LENGTH] or list(range(vocab))
    ids = torch.tensor((ids * (2 * PROBE_LENGTH // len(ids) + 1))[: 2 * PROBE_LENGTH]).view(2, PROBE_LENGTH)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def iter_merged_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the merged weights of a model in the Hub's own layout, one module at a time, for serving engines.

    The names and layout are those ``save_pretrained`` writes for the merged model (what vLLM's ``load_weights``
    takes): no ``base_model.model.``, ``.base_layer``, ``lora_*`` or ``modules_to_save.<adapter>``, and weights that
    transformers converts on load (fused MoE experts, renamed vision-language prefixes) converted back with its own
    reverse conversions. Tied weights are yielded once, under the name ``save_pretrained`` keeps.

    Args:
        model: A PEFT model (LoRA adapters are merged on the fly; the model itself is not modified) or a plain
            transformers model. Under ZeRO-3 each module is gathered on every rank in turn, so call it on every rank.

    Yields:
        ``(name, tensor)`` pairs; each tensor is a new tensor the caller may keep.

    Raises:
        NotImplementedError: for DoRA adapters (``trl_ext.merge.merge`` handles them).
    """
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    base = model.get_base_model() if is_peft_model(model) else model
    units = gather.FsdpUnits(model)  # FSDP2: each module is read with its unit's parameters unsharded
    done: list[str] = []  # prefixes of modules already yielded whole
    # Tied parameters under their first name only, as save_pretrained keeps (listed before FSDP2 swaps any in).
    first_names = {n for n, _ in base.named_parameters()} | {n for n, _ in base.named_buffers()}
    with torch.no_grad():
        for name, module in base.named_modules(remove_duplicate=False):
            if any(name.startswith(prefix) for prefix in done):
                continue
            prefix = f"{name}." if name else ""
            if isinstance(module, LoraLayer):
                done.append(prefix)
                with units.unsharded(module, subtree=True):
                    tensors = dict(_merged_lora(module, prefix))
            elif isinstance(module, ModulesToSaveWrapper):
                done.append(prefix)
                trained = module.modules_to_save[module.active_adapters[0]]
                with units.unsharded(trained, subtree=True), gather.gathered(list(trained.parameters())):
                    tensors = {prefix + k: t.detach().clone() for k, t in gather.module_tensors(trained).items()}
            else:
                with units.unsharded(module):  # unsharding swaps in other parameter objects: read them inside
                    own = {prefix + k: t for k, t in gather.module_tensors(module, recurse=False).items()
                           if prefix + k in first_names}
                    with gather.gathered(list(own.values())):
                        tensors = {name: t.detach().clone() for name, t in own.items()}
            if tensors:  # a module's tensors hold whole conversion groups (one module's experts, say)
                yield from hub_format.to_hub(base, tensors).items()


def _merged_lora(module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The wrapped module's tensors with the active adapters' deltas added, under the module's own names."""
    from peft.tuners.lora import LoraLayer

    if any(module.use_dora.get(a, False) for a in module.active_adapters):
        raise NotImplementedError("iter_merged_weights does not support DoRA adapters; use trl_ext.merge.merge")
    with gather.gathered(list(module.parameters())):
        deltas, layer = {}, module
        while isinstance(layer, LoraLayer):  # LoRA on parameters (MoE experts) nests one wrapper per parameter
            name = getattr(layer, "parameter_name", "weight")
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    deltas[name] = deltas.get(name, 0) + layer.get_delta_weight(adapter)
            layer = layer.base_layer
        for key, tensor in gather.module_tensors(layer).items():
            merged = tensor.detach().clone()
            if key in deltas:
                merged += deltas[key].to(merged.dtype)
            yield prefix + key, merged
