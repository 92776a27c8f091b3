"""Every save, reloaded with plain transformers + peft in a fresh process, gives the trained model's outputs.

Real 2-process DeepSpeed runs on CPU with parameters partitioned (ZeRO-3). Inside each run the model's outputs on
fixed probe inputs are recorded whenever a checkpoint is saved and at the end; here each saved directory is loaded
by ``tests/scripts/reload.py`` (no trl_ext, no DeepSpeed) and its outputs compared.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers.trainer_utils import get_last_checkpoint

from tests import reloading
from tests.distributed.conftest import SFT_LORA_ROUNDTRIP
from tests.harness import SCRIPTS, accelerate_launch, hang_bound, write_accelerate_config
from trl_ext.assets import default_model_path
from trl_ext.files.audit import audit

pytestmark = pytest.mark.slow

ATOL = 1e-5  # fp32: the same weights through the same forward, on one process instead of two


def run(tmp_path: Path, backend: str, trainer: str, *args: str, expect_success: bool = True, **zero) -> Path:
    config = write_accelerate_config(tmp_path / "configs", backend, **zero)
    out = tmp_path / "out"
    result = accelerate_launch(SCRIPTS / "save_roundtrip.py", ["--trainer", trainer, "--output_dir", str(out), *args],
                               config, timeout=hang_bound(300))
    assert not result.timed_out, result.output[-4000:]
    if expect_success:
        assert result.returncode == 0, result.output[-6000:]
    else:
        assert result.returncode != 0, "the run was meant to be killed mid-save"
    return out


def reloaded_outputs(checkpoints: list[Path], kind: str) -> dict[Path, torch.Tensor]:
    """Outputs of each checkpoint loaded in one fresh process with plain transformers + peft, after asserting that
    every file beside the weights is what ``save_pretrained`` writes (``tests/metadata.py``)."""
    kind = {"sft": "causal", "dpo": "causal"}.get(kind, kind)  # a trainer name, or reload.py's own kind
    found = reloading.reload(default_model_path(), kind, checkpoints, timeout=180)
    assert not any(found["metadata"].values()), found["metadata"]
    return {Path(path): torch.tensor(values) for path, values in found["outputs"].items()}


def recorded(out: Path, name: str) -> torch.Tensor:
    return torch.tensor(json.loads((out / "probes" / f"{name}.json").read_text()))


def assert_reload_identically(out: Path, names: list[str], trainer: str) -> None:
    for name in names:
        report = audit(str(out / name), base=default_model_path())
        assert report.ok, report.format()
    reloaded = reloaded_outputs([out / name for name in names], trainer)
    for name in names:
        expected, got = recorded(out, name), reloaded[out / name]
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=ATOL, rtol=0), f"{name}: max diff {(got - expected).abs().max()}"


CASES = {
    # name: backend, trainer, script args, DeepSpeed zero_optimization overrides
    "sft-lora-zero3": ("zero3", "sft", SFT_LORA_ROUNDTRIP, {}),  # shared with test_merge
    "reward-lora-zero3-gather-flag-off": (
        "zero3", "reward", ["--lora", "--save_steps", "2"], {"stage3_gather_16bit_weights_on_model_save": False}),
    "dpo-lora-zero3": ("zero3", "dpo", ["--lora"], {}),
    "sft-full-zero3-sharded": ("zero3", "sft", ["--save_steps", "2", "--max_shard_size", "100KB"], {}),
    "sft-full-zero3-gathered-whole": ("zero3", "sft", ["--max_shard_size", "100KB", "--gather_whole"], {}),
    "reward-full-zero2": ("zero2", "reward", ["--save_steps", "2"], {}),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.compat) if c == "sft-lora-zero3" else c
                                  for c in CASES])
def test_saved_checkpoints_reload_with_the_trained_outputs(roundtrip, case):
    backend, trainer, args, zero = CASES[case]
    out = roundtrip(backend, trainer, *args, **zero)
    report = json.loads((out / "report.json").read_text())
    assert report["zero_stage"] == int(backend[-1])
    if backend == "zero3":
        assert report["partitioned"], "ZeRO-3 did not partition the parameters: the test would prove nothing"

    saves = ["final"] + (["checkpoint-2", "checkpoint-4"] if "--save_steps" in args else [])
    assert_reload_identically(out, saves, trainer)
    if "checkpoint-2" in saves:  # an intermediate checkpoint really is the model at step 2, not the final one
        assert not torch.allclose(recorded(out, "checkpoint-2"), recorded(out, "final"), atol=1e-4)
    assert not list(out.glob(".*")), "partial directories were left behind"

    if "--lora" in args:
        with safe_open(str(out / "final" / "adapter_model.safetensors"), "pt") as f:
            keys = list(f.keys())
        assert keys and not [k for k in keys if ".default" in k]
        if trainer == "reward":
            assert "base_model.model.score.weight" in keys  # the head is saved whole, under its plain name
    if "--max_shard_size" in args:
        index = json.loads((out / "final" / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2
    if backend == "zero3":  # a plain save_pretrained is refused, or (params gathered by a forward) writes a sound model
        if report["partitioned"]:
            assert "trainer.save_model(output_dir)" in report["user_save_pretrained"]
            assert not (out / "user_save_pretrained").exists()
        else:
            assert audit(str(out / "user_save_pretrained")).ok


def test_kill_during_save_keeps_the_previous_checkpoint_and_resume_picks_it(tmp_path):
    args = ["--lora", "--save_steps", "1", "--max_steps", "3"]
    out = run(tmp_path, "zero3", "sft", *args, "--kill_during_save", "2", expect_success=False)

    assert (out / ".checkpoint-2.trl_ext-partial").is_dir(), "the kill did not happen while checkpoint-2 was written"
    assert not (out / "checkpoint-2").exists()
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-1")
    assert_reload_identically(out, ["checkpoint-1"], "sft")

    out = run(tmp_path, "zero3", "sft", *args, "--resume")
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    assert_reload_identically(out, ["checkpoint-2", "checkpoint-3", "final"], "sft")
    assert not list(out.glob(".*")), "the interrupted save's partial directory was not cleaned up"
