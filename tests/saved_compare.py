"""Compare what a training run saved with what it trained, and a reload's outputs with the trained model's: used by the
GPU check (bench/device_check.py) and its smoke test. Nothing here imports trl_ext.
"""

from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

# A reload's outputs against the trained model's, as a share of their largest: bf16 on a GPU rounds at about 2^-8 per
# operation (the trained model's forward ran under the engine, the reload's in plain transformers); fp32 agrees almost
# exactly.
REL_TOL = {"bfloat16": 0.02, "float32": 1e-4}
STATE_FILES = ("optimizer.pt", "scheduler.pt", "rng_state.pth")


def outputs_close(got, expected, dtype: str) -> tuple[bool, str]:
    """Whether outputs (nested lists) match the expected ones within ``REL_TOL[dtype]`` of their largest; and why.

    Args:
        got: the reload's outputs.
        expected: the trained model's.
        dtype: the dtype both computed in ("bfloat16" or "float32").

    Returns:
        (within the tolerance, a line giving the difference and the tolerance).
    """
    got, expected = torch.tensor(got), torch.tensor(expected)
    if got.shape != expected.shape:
        return False, f"shapes {tuple(got.shape)} vs {tuple(expected.shape)}"
    diff = (got - expected).abs().max().item()
    tol = REL_TOL[dtype] * max(expected.abs().max().item(), 1e-6)
    return diff <= tol, f"max |outputs - trained| {diff:.3g} (tolerance {tol:.3g})"


def differences(a, b, where: str = "") -> list[str]:
    """Where two saved objects differ: tensors bit for bit (dtype and shape too), nested dicts, lists and tuples item by
    item, numpy arrays and anything else by equality.

    Args:
        a: one object (a state dict, as ``torch.load`` or ``load_file`` returns it).
        b: the other.
        where: the path of ``a`` and ``b`` inside the objects compared (for the answer).

    Returns:
        The paths where they differ.
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
        return [] if same else [where or "tensor"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, set(a) ^ set(b)))[:5]}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return [] if np.array_equal(a, b) else [where]
    return [] if a == b else [where]


def same_checkpoint(first: Path, second: Path) -> list[str]:
    """How two ``checkpoint-N`` directories differ in their weights and optimizer, scheduler and RNG states.

    Args:
        first: one checkpoint.
        second: the other.

    Returns:
        The differences (none: every tensor identical).
    """
    found = []
    weights = sorted(p.name for p in first.glob("*.safetensors"))
    if weights != sorted(p.name for p in second.glob("*.safetensors")) or not weights:
        return [f"weight files {weights} vs {sorted(p.name for p in second.glob('*.safetensors'))}"]
    for name in weights:
        found += [f"{name}{d}" for d in differences(load_file(first / name), load_file(second / name))]
    for name in STATE_FILES:
        if (first / name).exists() != (second / name).exists():
            found.append(f"{name} in one checkpoint only")
        elif (first / name).exists():
            a, b = (torch.load(c / name, map_location="cpu", weights_only=False) for c in (first, second))
            found += [f"{name}{d}" for d in differences(a, b)]
    return found


def same_tensors(saved_dir: Path, trained_file: Path) -> list[str]:
    """How a save's weights differ from the trained ones (nothing: every saved weight that was trained equals it,
    value for value, and every trained one was saved; an adapter's keys lack PEFT's ``.default``).

    Args:
        saved_dir: the saved model or adapter.
        trained_file: the trained weights, gathered whole (``tests/scripts/train.py``'s ``trained.safetensors``).

    Returns:
        The problems found.
    """
    if not trained_file.exists():
        return [f"{trained_file.name} missing"]
    trained = {k.replace(".default.", "."): v for k, v in load_file(trained_file).items()}
    files = sorted(saved_dir.glob("*.safetensors"))
    if not files:
        return ["no safetensors file saved"]
    problems, compared = [], 0
    for file in files:
        for key, value in load_file(file).items():
            if key not in trained:
                if value.numel() == 0:
                    problems.append(f"{key} is empty")
                continue  # a frozen weight (LoRA's base): not trained, not gathered
            compared += 1
            if value.shape != trained[key].shape or not torch.equal(value.float(), trained[key].float()):
                problems.append(f"{key}: differs from the trained tensor")
    saved = _saved_keys(files)  # a tied head is saved once, as the embedding
    problems += [f"{k}: trained but not saved" for k in trained if k not in saved and "lm_head" not in k][:3]
    return problems if compared else problems + ["no trained tensor among the saved ones"]


def _saved_keys(files: list[Path]) -> set[str]:
    keys = set()
    for file in files:
        with safe_open(file, "pt") as f:
            keys.update(f.keys())
    return keys
