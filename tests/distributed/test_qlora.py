"""QLoRA (4-bit base + LoRA) for the three trainers under real 2-process ZeRO-3 and ZeRO-2 on CPU (bitsandbytes' CPU
backend): trains, saves an adapter that passes the audit, and reloads in a fresh process with plain transformers +
peft, on the 4-bit base and on the full-precision base, with outputs close to the trained model's.

The seven runs are trained first, one launch per engine (``run_many.py``), then every adapter is reloaded in one
fresh process (start-up costs more than a run or a reload). Run as ``python -m tests.distributed.test_qlora BASE
QUANT_TYPE KIND:ADAPTER...`` this file is the reload script (it imports no trl_ext).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.conftest import SharedRuns
from tests.harness import REPO

pytestmark = pytest.mark.slow

# Tolerances, on the trained model's outputs (logits, or rewards) at fixed inputs:
# - reloaded on the 4-bit base: the same NF4 weights and adapter, one process without DeepSpeed instead of two with it
#   (measured: 0.0). Both sides run bitsandbytes' training kernel: the trainers switch off its CPU packed path (see
#   quantization.disable_cpu_packed_path), and so does the reload, so the check means the same on every x86 CPU.
ATOL_4BIT = 1e-5
# - reloaded on the full-precision base: quantization is lossy, so the outputs differ by the base's 4-bit error. Bound:
#   no more than 1.25x the error of the base alone (max|full base - 4-bit base|, no adapter, same inputs; measured
#   ratio 0.99-1.06). The adapter must also still do what it did in training: its effect on the full-precision base
#   (with - without adapter) within 25% of its effect on the 4-bit base (measured 9-10%).
QUANTIZATION_ERROR_MARGIN = 1.25
ADAPTER_EFFECT_RTOL = 0.25

PROBE_IDS = [[10 + i for i in range(12)], [40 + 3 * i for i in range(12)]]  # as tests/scripts/train.py

CASES = [(trainer, backend) for trainer in ("sft", "reward", "dpo") for backend in ("zero3", "zero2")] + [
    ("sft", "fsdp2")]


def run_reload(adapters: dict[Path, str], quant_type: str) -> subprocess.CompletedProcess:
    """Reload each adapter (path -> "causal" or "reward") in one fresh process."""
    from trl_ext.assets import default_model_path

    pairs = [f"{kind}:{adapter}" for adapter, kind in adapters.items()]
    return subprocess.run([sys.executable, "-m", "tests.distributed.test_qlora", default_model_path(), quant_type,
                           *pairs], cwd=REPO, capture_output=True, text=True, timeout=240, check=False)


def damage(adapter: Path, how: str, directory: Path) -> Path:
    """A copy of ``adapter`` with one layer's lora_B back at its initial value (zeros, "wrong"), or without one
    lora_B tensor ("missing")."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(adapter / "adapter_model.safetensors")
    lora_b = sorted(k for k in tensors if "lora_B" in k)
    damaged = directory / f"adapter_{how}"
    shutil.copytree(adapter, damaged)
    if how == "wrong":  # as if never trained
        tensors[lora_b[0]] = torch.zeros_like(tensors[lora_b[0]])
    else:
        del tensors[lora_b[-1]]
    save_file(tensors, damaged / "adapter_model.safetensors", metadata={"format": "pt"})
    return damaged


def train_args(trainer: str) -> list[str]:
    as_dict = trainer == "dpo"  # the YAML path: quantization_config given as a dict
    return ["--trainer", trainer, "--lora", "--load_in_4bit", "--save_model", "final", "--max_steps", "2", "--rows",
            "8", "--eval_steps", "1", "--quant_config_as", "dict" if as_dict else "object"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Each case trained (an engine's cases one after another in one launch), then every adapter, and a damaged one,
    reloaded in one process.

    Returns {(trainer, backend): (output dir, report, reloaded outputs)}, plus "damaged": the "wrong" adapter's
    reloaded outputs and the "missing" one's reload process (which must fail).
    """
    found, adapters = {}, {}
    shared_runs = SharedRuns(tmp_path_factory.mktemp("qlora"))  # this module's own (no other module reads them)
    for backend in dict.fromkeys(backend for _, backend in CASES):
        shared_runs.many("train.py", backend, [train_args(t) for t, b in CASES if b == backend])
    for trainer, backend in CASES:
        out = shared_runs.get("train.py", backend, train_args(trainer))
        found[trainer, backend] = out, json.loads((out / "report_rank0.json").read_text())
        adapters[out / "final"] = "reward" if trainer == "reward" else "causal"
    # one training run serves the damaged-adapter checks
    sft_adapter = found["sft", "zero3"][0] / "final"
    wrong, missing = (damage(sft_adapter, how, tmp_path_factory.mktemp(how)) for how in ("wrong", "missing"))
    proc = run_reload({**adapters, wrong: "causal"}, "nf4")
    assert proc.returncode == 0, proc.stderr[-4000:]
    reloaded = {Path(a): {k: torch.tensor(v) for k, v in outs.items()}
                for a, outs in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    result = {case: (out, report, reloaded[out / "final"]) for case, (out, report) in found.items()}
    result["damaged"] = reloaded[wrong], run_reload({missing: "causal"}, "nf4")
    return result


def assert_damaged_adapters_fail(damaged: tuple, trained: torch.Tensor) -> None:
    """The 4-bit check is strong enough to catch a wrong adapter tensor, and the reload one a missing tensor."""
    wrong, missing = damaged
    assert missing.returncode != 0 and "missing adapter keys" in missing.stderr, missing.stderr[-2000:]
    off = (wrong["4bit"] - trained).abs().max().item()
    print(f"one untrained lora_B tensor: 4-bit reload off by {off:.3g} (tolerance {ATOL_4BIT})")
    assert off > 10 * ATOL_4BIT, "a wrong lora_B tensor passed the 4-bit reload check"


@pytest.mark.parametrize(("trainer", "backend"), CASES)
def test_qlora_trains_saves_and_reloads(runs, trainer, backend):
    from trl_ext.assets import default_model_path
    from trl_ext.files.audit import audit

    out, report, got = runs[trainer, backend]
    stage = None if backend == "fsdp2" else int(backend[-1])
    assert report["zero_stage"] == stage and report["world_size"] == 2
    quant = report["quantization"]
    assert quant["num_4bit"] > 0, "the base was not loaded in 4-bit"
    # ZeRO-3 and FSDP2: storage follows the training dtype (fp32 on CPU); ZeRO-2 keeps bitsandbytes' uint8
    assert quant["storage"] == (["torch.uint8"] if stage == 2 else ["torch.float32"])
    if backend == "fsdp2":
        # after an eval forward FSDP2 keeps the root module's own parameters (the final norm) unsharded
        dtensors, _, total = report["fsdp_sharded"]
        assert report["distributed_type"] == "FSDP" and dtensors >= total - 1, report["fsdp_whole"]
    assert quant["trainable"] == quant["frozen_float"] == ["torch.float32"], "adapter and base dtypes differ"
    if stage == 3:
        partition = report["partition"]
        assert partition["num_partitioned"] == partition["num_params"], "ZeRO-3 did not partition every parameter"

    adapter = out / "final"
    result = audit(str(adapter), base=default_model_path())
    assert result.ok, result.format()
    trained = torch.tensor(json.loads((out / "probes_final.json").read_text()))
    diff_4bit = (got["4bit"] - trained).abs().max().item()
    diff_full = (got["full"] - trained).abs().max().item()
    base_error = (got["base_4bit"] - got["base_full"]).abs().max().item()
    effect = trained - got["base_4bit"]  # what the trained adapter (and reward head) changes
    effect_error = ((got["full"] - got["base_full"]) - effect).abs().max().item()
    print(f"{trainer}/{backend}: max|diff| vs trained: 4-bit base {diff_4bit:.3g}, full-precision base {diff_full:.3g} "
          f"(base quantization error {base_error:.3g}); adapter effect {effect.abs().max():.3g}, off by "
          f"{effect_error:.3g} on the full-precision base")
    assert effect.abs().max() > 10 * ATOL_4BIT, "training did not change the outputs: the checks would prove nothing"
    assert diff_4bit <= ATOL_4BIT, f"reloaded on the 4-bit base: max diff {diff_4bit}"
    assert diff_full <= QUANTIZATION_ERROR_MARGIN * base_error, (
        f"reloaded on the full-precision base: max diff {diff_full}, base quantization error {base_error}")
    assert effect_error <= ADAPTER_EFFECT_RTOL * effect.abs().max(), (
        f"the adapter's effect on the full-precision base is off by {effect_error}")
    if (trainer, backend) == ("sft", "zero3"):  # the run the damaged adapters were made from
        assert_damaged_adapters_fail(runs["damaged"], trained)


def _probe(model) -> list:
    model.eval()
    with torch.no_grad():
        ids = torch.tensor(PROBE_IDS)
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().tolist()


def _training_kernel(model):
    """Keep bitsandbytes off its CPU packed path, as the trainers do: on a CPU with AVX512-BF16 an eval forward would
    otherwise use another kernel (bf16 scales), and PEFT's wrapping then unpacks the weights lossily."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def _reload(base: str, kind: str, adapter: str, quant_type: str) -> dict:
    """The adapter's outputs on the full-precision and on the 4-bit base, and both bases' alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, BitsAndBytesConfig

    tokenizer = AutoTokenizer.from_pretrained(adapter)
    auto, extra = AutoModelForCausalLM, {}
    if kind == "reward":
        auto, extra = AutoModelForSequenceClassification, {"num_labels": 1, "pad_token_id": tokenizer.pad_token_id}
    four_bit = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype="float32")
    outputs = {}
    for name, kwargs in {"full": {}, "4bit": {"quantization_config": four_bit}}.items():
        torch.manual_seed(0)
        model = _training_kernel(auto.from_pretrained(base, dtype=torch.float32, **extra, **kwargs))
        outputs[f"base_{name}"] = _probe(model)
        outputs[name] = _probe(PeftModel.from_pretrained(model, adapter))
    return outputs


def _reload_main(base: str, quant_type: str, *pairs: str) -> None:
    found = {}
    for pair in pairs:
        kind, adapter = pair.split(":", 1)
        found[adapter] = _reload(base, kind, adapter, quant_type)
    print(json.dumps(found))


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("error", message=".*missing adapter keys.*")  # a head or LoRA weight not restored
    _reload_main(*sys.argv[1:])
