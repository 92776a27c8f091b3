"""Each trainer trains a few steps on 2 CPU processes under real DeepSpeed ZeRO-2 and ZeRO-3."""

import math

import pytest

from tests.harness import run_training

pytestmark = pytest.mark.slow

# (trainer, LoRA?) pairs: every trainer under both stages; LoRA and full fine-tuning both covered.
CASES = [("sft", False), ("sft", True), ("reward", True), ("dpo", True), ("dpo", False)]


@pytest.mark.parametrize("backend", ["zero2", "zero3"])
@pytest.mark.parametrize("trainer,lora", CASES, ids=[f"{t}-{'lora' if lora else 'full'}" for t, lora in CASES])
def test_trains_under_zero(tmp_path, backend, trainer, lora):
    report = run_training(tmp_path, backend, trainer, *(["--lora"] if lora else []))
    assert report["world_size"] == 2
    assert report["zero_stage"] == int(backend[-1])
    assert report["global_step"] == 3 and len(report["losses"]) == 3
    assert all(math.isfinite(loss) for loss in report["losses"])


def test_zero3_really_partitions_the_tiny_model(tmp_path):
    """With stage3_param_persistence_threshold=0 every parameter is a (0,) placeholder with its full ds_shape."""
    report = run_training(tmp_path, "zero3", "sft", "--lora")
    partition = report["partition"]
    assert partition["num_params"] > 0
    assert partition["num_partitioned"] == partition["num_params"]
    local_shape, full_shape = partition["example"]
    assert local_shape == [0] and len(full_shape) >= 1 and all(d > 0 for d in full_shape)


def test_zero2_does_not_partition_parameters(tmp_path):
    report = run_training(tmp_path, "zero2", "sft", "--lora")
    assert report["partition"]["num_partitioned"] == 0


def test_ddp_on_cpu(tmp_path):
    report = run_training(tmp_path, "ddp", "dpo", "--lora")
    assert report["world_size"] == 2 and report["zero_stage"] is None
    # really data parallel: accelerate's CPU multi-process mode, the model wrapped in DDP (gradients averaged)
    assert report["distributed_type"] == "MULTI_CPU" and report["ddp_wrapped"], report
