"""Reload saved models as a user does, with plain transformers + peft (this process never imports trl_ext, TRL or
DeepSpeed), and answer with their outputs on fixed probe inputs. Started by bench/device_check.py when the check
starts, so that its imports overlap the training; it then answers one request per line.

Request (a JSON line on stdin): ``{"id", "path", "base", "dtype", "device", "attn", "four_bit", "with_base"}`` where
``path`` is a full model, or an adapter when ``base`` is given; ``four_bit`` is ``{"quant_type", "compute_dtype"}`` to
load the base in 4-bit (bitsandbytes). Answer (a line on stdout starting with ``RELOAD ``): ``{"id", "logits",
"base_logits" (with ``with_base``), "metadata": [files that differ from what save_pretrained writes], "seconds"}``, or
``{"id", "error"}``. An adapter that PEFT loads with missing keys is an error.
"""

import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.metadata

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from tests.metadata import metadata_problems

PROBE_IDS = [[10 + i for i in range(12)], [40 + 3 * i for i in range(12)]]  # as tests/scripts/train.py


def probe(model, device: str) -> list:
    model.eval()
    with torch.no_grad():
        ids = torch.tensor(PROBE_IDS, device=device)
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().cpu().tolist()


def training_kernel(model):
    """On a CPU, keep bitsandbytes off its packed AVX512-BF16 path, as the trainers do (see tests/distributed/
    test_qlora.py): the reload then runs the kernel training ran."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def saved_dtype(path: str):
    """The dtype of the floating-point tensors a full-model save holds (None if mixed or none)."""
    import glob

    from safetensors import safe_open

    dtypes = set()
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(file, "pt") as f:
            dtypes.update(f.get_slice(k).get_dtype() for k in f.keys())
    floats = {getattr(torch, {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[d]) for d in dtypes
              if d in ("F32", "BF16", "F16")}
    return floats.pop() if len(floats) == 1 else None


def load_base(name: str, request: dict):
    kwargs = {"dtype": getattr(torch, request.get("dtype", "float32"))}
    if request.get("attn"):
        kwargs["attn_implementation"] = request["attn"]
    four_bit = request.get("four_bit")
    if four_bit:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=four_bit["quant_type"],
            bnb_4bit_compute_dtype=four_bit["compute_dtype"])
        kwargs["device_map"] = {"": request["device"]}
    model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    if not four_bit:
        model = model.to(request["device"])
    return training_kernel(model)


def answer(request: dict) -> dict:
    start = time.perf_counter()
    path, base, device = request["path"], request.get("base"), request["device"]
    found = {"id": request["id"]}
    if base:
        from peft import PeftModel

        model = load_base(base, request)
        if request.get("with_base"):
            found["base_logits"] = probe(model, device)
        model = PeftModel.from_pretrained(model, path)
    else:
        model = load_base(path, request)
    found["logits"] = probe(model, device)
    if not request.get("four_bit"):  # save_pretrained of a 4-bit model writes its quantization config too
        if not base:  # save_pretrained writes the dtype the model is in: the saved tensors' (FSDP2 trains in fp32)
            model = model.to(saved_dtype(path) or model.dtype)
        found["metadata"] = metadata_problems(path, model, AutoTokenizer.from_pretrained(path))
    found["seconds"] = time.perf_counter() - start
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return found


def main() -> None:
    warnings.filterwarnings("error", message=".*missing adapter keys.*")  # a head or LoRA weight not restored
    print("RELOAD " + json.dumps({"id": "ready"}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        try:
            found = answer(request)
        except Exception:  # noqa: BLE001 - reported to the check, which goes on with the next request
            found = {"id": request.get("id"), "error": traceback.format_exc()[-3000:]}
        print("RELOAD " + json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
