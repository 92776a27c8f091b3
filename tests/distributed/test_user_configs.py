"""The DeepSpeed configs users already have train unchanged on a CPU-only machine (2 processes).

TRL ships accelerate configs in the trl package (``trl/accelerate_configs/zero{1,2,3}.yaml``: ``mixed_precision:
bf16``, ``num_processes: 8``): they run as they are, with only ``--num_processes`` given on the command line. DeepSpeed
JSONs with an explicit ``fp16`` block with loss scaling run through a user script, and with a ``bf16`` block through a
recipe. Every source of precision then agrees with the fp32 fallback, announced in one line, and the user's file is
left as it was.
"""

import json
import sys
from pathlib import Path

import pytest
import trl
import yaml

from tests.harness import SCRIPTS, run_command

pytestmark = pytest.mark.slow

TRL_CONFIGS = Path(trl.__file__).parent / "accelerate_configs"
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
FALLBACK = "is not supported on this hardware"


def launch_user_script(config: Path, out: Path, *extra: str):
    cmd = [*ACCELERATE, "--config_file", str(config), "--num_processes", "2", "--main_process_port", "0",  # a free one
           str(SCRIPTS / "train.py"), "--trainer", "sft", "--output_dir", str(out), "--max_steps", "2", "--rows", "8",
           *extra]
    return run_command(cmd, timeout=300)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_trls_shipped_deepspeed_configs_run_unchanged(tmp_path, stage):
    config = TRL_CONFIGS / f"zero{stage}.yaml"
    assert yaml.safe_load(config.read_text())["mixed_precision"] == "bf16"
    result = launch_user_script(config, tmp_path / "out", "--save_model", "final")
    assert result.returncode == 0 and not result.timed_out, result.output[-6000:]
    assert result.output.count(FALLBACK) == 1 and "accelerate mixed_precision" in result.output
    report = json.loads((tmp_path / "out" / "report_rank0.json").read_text())
    assert report["zero_stage"] == stage and report["world_size"] == 2


def _accelerate_config_with(tmp_path: Path, deepspeed: dict) -> Path:
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                              "train_batch_size": "auto", **deepspeed}))
    config = tmp_path / "accelerate.yaml"
    config.write_text(yaml.safe_dump({
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "num_machines": 1,
        "num_processes": 2, "machine_rank": 0, "main_training_function": "main", "rdzv_backend": "static",
        "same_network": True, "use_cpu": False,
        "deepspeed_config": {"deepspeed_config_file": str(ds), "zero3_init_flag": True},
    }))
    return config


BF16_ZERO3 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
FP16_ZERO2 = {"fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                       "hysteresis": 2, "min_loss_scale": 1}, "zero_optimization": {"stage": 2}}


def assert_unchanged(ds: Path, deepspeed: dict) -> None:
    assert json.loads(ds.read_text()) == {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        **deepspeed}, "the user's file was changed"


def test_explicit_fp16_deepspeed_json_through_a_user_script(tmp_path):
    config = _accelerate_config_with(tmp_path, FP16_ZERO2)
    result = launch_user_script(config, tmp_path / "out")
    assert result.returncode == 0 and not result.timed_out, result.output[-6000:]
    assert result.output.count(FALLBACK) == 1 and "DeepSpeed" in result.output
    assert_unchanged(tmp_path / "ds.json", FP16_ZERO2)


def test_explicit_bf16_deepspeed_json_through_a_recipe(tmp_path):
    config = _accelerate_config_with(tmp_path, BF16_ZERO3)
    out = tmp_path / "run"
    result = run_command([sys.executable, "recipes/sft.py", "--config", str(config), "--output_dir", str(out),
                          "--max_steps", "2", "--eval_strategy", "no"], timeout=300)
    assert result.returncode == 0 and not result.timed_out, result.output[-6000:]
    assert "running under" in result.output and f"saved and verified: {out}" in result.output
    assert FALLBACK in result.output
    assert_unchanged(tmp_path / "ds.json", BF16_ZERO3)
