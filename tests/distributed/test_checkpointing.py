"""Non-reentrant gradient checkpointing under 2-process ZeRO-3 with LoRA (parameters partitioned)."""

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import run_training
from trl_ext import checkpointing

pytestmark = pytest.mark.slow


def _run(tmp_path, trainer, gc, *extra):
    report = run_training(tmp_path / gc, "zero3", trainer, "--lora", "--gc", gc, *extra)
    assert report["partition"]["num_partitioned"] == report["partition"]["num_params"]
    return report, load_file(tmp_path / gc / "out" / "trained.safetensors")


@pytest.mark.parametrize("trainer", [pytest.param("sft", marks=pytest.mark.compat), "reward", "dpo"])
def test_default_is_non_reentrant_in_every_layer(tmp_path, trainer):
    """On a DeepSpeed without the recompute fix (the oldest supported one), the reentrant fallback, said in one line."""
    fixed = checkpointing.deepspeed_keeps_frozen_params_on_recompute()
    report, _ = _run(tmp_path, trainer, "default")
    layers = report["checkpointing"]["layers"]
    assert len(layers) == 2 and set(layers.values()) == {not fixed}  # both decoder layers, as actually called
    # no input-require-grads hook with non-reentrant; reentrant needs it
    assert (report["checkpointing"]["input_hooks"] > 0) is not fixed
    fallback = f"Upgrade to deepspeed>={checkpointing.DEEPSPEED_FIX_VERSION} to remove this."
    assert report["output"].count(fallback) == (0 if fixed else 1)  # rank 0 says it once


def test_explicit_reentrant_is_honoured(tmp_path):
    report, _ = _run(tmp_path, "sft", "reentrant")
    assert set(report["checkpointing"]["layers"].values()) == {True}
    assert report["checkpointing"]["input_hooks"] > 0  # reentrant needs it


@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_same_losses_and_weights_with_and_without_reentrant_or_checkpointing(tmp_path, trainer):
    runs = {gc: _run(tmp_path, trainer, gc, "--grad_accum", "2", "--max_steps", "3") for gc in
            ("nonreentrant", "reentrant", "off")}
    ref_report, ref_weights = runs["nonreentrant"]
    assert set(ref_report["checkpointing"]["layers"].values()) == {False}
    assert runs["off"][0]["checkpointing"]["layers"] == {}
    assert any(name.endswith("lora_B.default.weight") for name in ref_weights)
    assert any(w.abs().sum() > 0 for n, w in ref_weights.items() if "lora_B" in n)  # LoRA B moved off zero
    for gc in ("reentrant", "off"):
        report, weights = runs[gc]
        assert report["losses"] == pytest.approx(ref_report["losses"], rel=1e-5, abs=1e-6), gc
        assert weights.keys() == ref_weights.keys()
        for name, tensor in ref_weights.items():
            torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=f"{gc}: {name}")
