"""What both merges (streamed and in memory) check and share before anything is read whole: the adapter read and
audited, its base named, a quantized base refused, the output directory, and the end-to-end probe with its
tolerance. One place, so that the two merges refuse the same things with the same words."""

import json
from pathlib import Path

import torch

from trl_ext.assets import resolve_model
from trl_ext.errors import MergeError
from trl_ext.files import audit
from trl_ext.files.reader import SafetensorsReader

PROBE_LENGTH = 16  # tokens per row of the end-to-end probe (two rows)
PROBE_VOCAB = 4096  # probe ids come from the first ids of the vocabulary, specials skipped


def check_out_dir(out: Path) -> None:
    """The output must not exist, or be an empty directory: nothing of the user's is ever overwritten."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MergeError(f"{out} already exists and is not empty; nothing was changed. Choose a new --out.")


def adapter_config(adapter: Path) -> dict:
    """The adapter's ``adapter_config.json``; one adapter per merge.

    Raises:
        MergeError: no adapter there, or a directory that holds several adapters.
    """
    if not (adapter / "adapter_config.json").exists():
        raise MergeError(f"{adapter} is not a PEFT adapter: adapter_config.json is missing")
    others = sorted(p.name for p in adapter.iterdir() if (p / "adapter_config.json").exists())
    if others:
        raise MergeError(f"{adapter} holds several adapters (the default and {', '.join(others)}); merge one at a "
                         f"time: --adapter {adapter / others[0]} --out M1, then the next with --base M1")
    return json.loads((adapter / "adapter_config.json").read_text())


def base_name(config: dict, base: str | None) -> str:
    """The base to merge into: ``base``, else the one the adapter records (embedded names resolved)."""
    name = base or config.get("base_model_name_or_path")
    if not name:
        raise MergeError("the adapter does not record its base model; pass --base")
    return resolve_model(name)


def head_outputs(adapter: Path, config: dict) -> int | None:
    """A SEQ_CLS adapter's head size (rows of its saved ``score``/``classifier``; 1 for a reward model), or None."""
    if config.get("task_type") != "SEQ_CLS":
        return None
    file = adapter / audit.ADAPTER_WEIGHTS
    if file.exists():
        reader = SafetensorsReader([file])
        shapes = {n: s.spec.shape for n, s in reader.tensors.items()}
        reader.close()
    else:
        from peft.utils import load_peft_weights

        shapes = {n: tuple(t.shape) for n, t in load_peft_weights(str(adapter), device="cpu").items()}
    for name, shape in shapes.items():
        short = name.removeprefix("base_model.model.")
        if short.split(".")[0] in audit.HEAD_NAMES and short.endswith("weight") and "lora_" not in short:
            return shape[0]
    return 1


def refuse_quantized(name: str, config, dequantize: bool = False) -> None:
    """A quantized base is refused unless the user asks to dequantize it (in memory)."""
    quantization = getattr(config, "quantization_config", None)
    if quantization and not dequantize:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        raise MergeError(
            f"the base {name} is a quantized checkpoint ({method}): merging into quantized weights loses the adapter's "
            "precision. Merge into the full-precision base (--base <its original model>), or pass --dequantize-base "
            "to load it and dequantize it first (in memory).")


def audit_adapter(adapter: Path, base: str | None, num_labels: int | None) -> None:
    """The adapter must pass the ``trl-ext verify`` audit (against ``base``'s shapes when given)."""
    report = audit.audit(str(adapter), base=base, num_labels=num_labels or 1)
    if not report.ok:
        raise MergeError("the adapter is damaged or does not fit this base model:\n" + report.format())


def probe_ids(config) -> torch.Tensor:
    """Two rows of ``PROBE_LENGTH`` valid token ids, without the config's special tokens (image tokens included)."""
    text = config.get_text_config()
    special = {v for k, v in {**config.to_dict(), **text.to_dict()}.items()
               if isinstance(v, int) and (k.endswith("_token_id") or k.endswith("_token_index"))}
    ids = [i for i in range(3, min(text.vocab_size, PROBE_VOCAB)) if i not in special][: 2 * PROBE_LENGTH]
    ids = ids or list(range(text.vocab_size))
    return torch.tensor((ids * (2 * PROBE_LENGTH // len(ids) + 1))[: 2 * PROBE_LENGTH]).view(2, PROBE_LENGTH)


def check_outputs(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """The merged model's logits against the adapter model's: the largest difference, within the dtype's tolerance
    (1e-4 in float32, 5e-2 in 16-bit formats).

    Raises:
        MergeError: beyond the tolerance; nothing was written.
    """
    diff = (got.float() - want.float()).abs().max().item()
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    if not diff <= tolerance:
        raise MergeError(f"the merged model's outputs differ from the adapter model's by {diff:.3g} (tolerance "
                         f"{tolerance}); nothing was written")
    return diff
