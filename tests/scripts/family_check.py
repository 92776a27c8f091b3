"""Check the families' saves in a fresh process with plain transformers and peft (no trl_ext imported).

``python -m tests.scripts.family_check SPEC.json`` where SPEC maps each run directory (see ``family_train.py``) to
``{"base": PATH, "model_class": NAME, "mode": "lora"|"experts"|"full", "reward": bool, "merged": DIR or null}``.
Prints one JSON object: per run, the measured differences, whether the weight files hold what ``save_pretrained``
writes, and ``metadata``: every other file that differs from what ``save_pretrained`` writes (``tests/metadata.py``),
for the save and for the ``trl-ext merge`` output.
"""

import glob
import json
import os
import sys
import tempfile

import torch
import transformers
from peft import PeftModel
from safetensors import safe_open

from tests.metadata import metadata_problems

PROBE_IDS = [[10 + i for i in range(12)], [40 + 3 * i for i in range(12)]]  # as family_train.py


def headers(directory: str) -> dict[str, tuple[list[int], str]]:
    """Every tensor's name, shape and dtype in the directory's safetensors files."""
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                piece = f.get_slice(name)
                out[name] = (piece.get_shape(), piece.get_dtype())
    return out


def tensors(directory_or_file: str) -> dict[str, torch.Tensor]:
    paths = [directory_or_file] if directory_or_file.endswith(".safetensors") else sorted(
        glob.glob(os.path.join(directory_or_file, "*.safetensors")))
    out = {}
    for path in paths:
        with safe_open(path, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


def probe(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        ids = torch.tensor(PROBE_IDS)
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()


def max_diff(a: torch.Tensor, b) -> float:
    return (a - torch.tensor(b)).abs().max().item()


def load(path: str, spec: dict):
    if spec["reward"]:
        return transformers.AutoModelForSequenceClassification.from_pretrained(path, num_labels=1,
                                                                                dtype=torch.float32)
    return getattr(transformers, spec["model_class"]).from_pretrained(path, dtype=torch.float32)


def tensors_equal(got: dict, expected: dict, atol: float) -> tuple[bool, float]:
    if set(got) != set(expected):
        return False, float("inf")
    worst = max(((got[k].float() - expected[k].float()).abs().max().item() for k in got), default=0.0)
    return worst <= atol, worst


def check(run: str, spec: dict) -> dict:
    final = os.path.join(run, "final")
    trained = json.load(open(os.path.join(run, "probes_final.json")))
    result = {}
    scratch = tempfile.mkdtemp()
    base = load(spec["base"], spec)
    if not spec["reward"]:  # a reward base gets a new random head at every load: nothing to compare before training
        result["diff_loaded"] = max_diff(probe(base), json.load(open(os.path.join(run, "probes_loaded.json"))))
    tokenizer = transformers.AutoTokenizer.from_pretrained(final)
    if spec["mode"] != "full":  # an adapter
        model = PeftModel.from_pretrained(base, final)
        result["metadata"] = metadata_problems(final, model, tokenizer)  # PEFT's reload writes what it read
        result["diff_final"] = max_diff(probe(model), trained)
        model.save_pretrained(os.path.join(scratch, "peft"))  # what PEFT itself writes for these weights
        result["files_as_save_pretrained"] = headers(final) == headers(os.path.join(scratch, "peft"))
        merged = model.merge_and_unload()
    else:
        merged = load(final, spec)
        result["metadata"] = metadata_problems(final, merged, tokenizer, reference=os.path.join(run, "reference"))
        result["diff_final"] = max_diff(probe(merged), trained)
    hub = os.path.join(scratch, "hub")
    merged.save_pretrained(hub)  # the merged model in the Hub's own format, as PEFT and transformers write it
    tokenizer.save_pretrained(hub)
    if spec["mode"] == "full":
        result["files_as_save_pretrained"] = headers(final) == headers(hub)
    result["iter_equal"], result["iter_diff"] = tensors_equal(tensors(os.path.join(run, "iter.safetensors")),
                                                              tensors(hub), atol=1e-6)
    if spec.get("merged"):
        merged_cli = load(spec["merged"], spec)
        result["metadata"] += metadata_problems(spec["merged"], merged_cli, reference=hub)
        result["merge_diff"] = max_diff(probe(merged_cli), trained)
        merged_cli.save_pretrained(os.path.join(scratch, "merged_hub"))
        result["merge_as_save_pretrained"] = headers(spec["merged"]) == headers(os.path.join(scratch, "merged_hub"))
    return result


def main(spec_path: str) -> None:
    import warnings

    warnings.filterwarnings("error", message=".*missing adapter keys.*")  # a head or LoRA weight not restored
    specs = json.load(open(spec_path))
    print(json.dumps({run: check(run, spec) for run, spec in specs.items()}))


if __name__ == "__main__":
    main(sys.argv[1])
