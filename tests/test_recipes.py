"""The recipes as users run them: `python recipes/X.py --config recipes/configs/X.yaml`, and under ZeRO-3."""

import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from tests.harness import REPO, launch, write_accelerate_config
from trl_ext.assets import default_model_path
from trl_ext.verify import audit

SHORT = ["--max_steps", "4", "--eval_steps", "2", "--logging_steps", "2", "--per_device_eval_batch_size", "64"]


def run_recipe(name, *args):
    cmd = [sys.executable, f"recipes/{name}.py", "--config", f"recipes/configs/{name}.yaml", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.parametrize("name", ["sft", "reward", "dpo"])
def test_recipe_trains_saves_and_reloads(name, tmp_path):
    out = tmp_path / name
    result = run_recipe(name, "--output_dir", str(out), *SHORT)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"saved to {out}" in result.stdout
    assert "eval_loss" in result.stdout + result.stderr
    if name == "reward":
        assert AutoModelForSequenceClassification.from_pretrained(out).config.num_labels == 1
    else:
        AutoModelForCausalLM.from_pretrained(out)


def test_recipe_refuses_to_train_over_another_run(tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"precious")
    result = run_recipe("dpo", "--output_dir", str(out), *SHORT)
    assert result.returncode != 0
    assert "already holds files" in result.stderr
    assert (out / "model.safetensors").read_bytes() == b"precious"
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


@pytest.mark.slow
def test_dpo_recipe_under_zero3_with_lora(tmp_path):
    config = write_accelerate_config(tmp_path, "zero3")
    out = tmp_path / "run"
    result = launch(REPO / "recipes" / "dpo.py", ["--config", "recipes/configs/dpo.yaml", "--output_dir", str(out),
                                                  "--use_peft", "--lora_r", "4", *SHORT], config, timeout=300)
    assert result.returncode == 0, result.output[-6000:]
    assert "gloo backend" in result.output
    assert (out / "adapter_config.json").exists()
    report = audit(str(out), base=default_model_path())
    assert report.ok, report.format()
