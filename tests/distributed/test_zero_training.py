"""Each trainer trains a few steps on 2 CPU processes under real DeepSpeed ZeRO-2 and ZeRO-3.

The ZeRO-3 runs are the shared uninterrupted runs of test_reliability (``zero3_run``, tests/distributed/conftest.py);
the ZeRO-2 runs are made here in one launch and serve two tests.
"""

import json
import math

import pytest
import torch

from tests.distributed.conftest import ZERO3_CASES, ZERO3_TRAIN, train_args
from tests.distributed.test_saving import reloaded_outputs
from tests.harness import run_training

pytestmark = pytest.mark.slow

# (trainer, LoRA?) pairs: every trainer under both stages; LoRA and full fine-tuning both covered.
CASES = ZERO3_CASES
IDS = [f"{t}-{'lora' if lora else 'full'}" for t, lora in CASES]


@pytest.fixture(scope="module")
def zero2_run(shared_runs):
    def run(trainer: str, lora: bool) -> dict:
        shared_runs.many("train.py", "zero2", [train_args(*case) for case in CASES])
        out = shared_runs.get("train.py", "zero2", train_args(trainer, lora))
        return json.loads((out / "report_rank0.json").read_text())

    return run


def assert_trained(report: dict, stage: int, steps: int) -> None:
    assert report["world_size"] == 2
    assert report["zero_stage"] == stage
    assert report["global_step"] == steps and len(report["losses"]) == steps
    assert all(math.isfinite(loss) for loss in report["losses"])


@pytest.mark.parametrize("trainer,lora", CASES, ids=IDS)
def test_trains_under_zero2(zero2_run, trainer, lora):
    assert_trained(zero2_run(trainer, lora), 2, 3)  # train.py's default: 3 steps


@pytest.mark.parametrize("trainer,lora", CASES, ids=IDS)
def test_trains_under_zero3(zero3_run, trainer, lora):
    assert_trained(zero3_run(trainer, lora)[1], 3, int(ZERO3_TRAIN[1]))


def test_zero3_really_partitions_the_tiny_model(zero3_run):
    """With stage3_param_persistence_threshold=0 every parameter is a (0,) placeholder with its full ds_shape."""
    partition = zero3_run("sft", True)[1]["partition"]
    assert partition["num_params"] > 0
    assert partition["num_partitioned"] == partition["num_params"]
    local_shape, full_shape = partition["example"]
    assert local_shape == [0] and len(full_shape) >= 1 and all(d > 0 for d in full_shape)


def test_zero2_does_not_partition_parameters(zero2_run):
    assert zero2_run("sft", True)["partition"]["num_partitioned"] == 0


def test_ddp_on_cpu(tmp_path):
    report = run_training(tmp_path, "ddp", "dpo", "--lora", "--save_model", "final")
    assert report["world_size"] == 2 and report["zero_stage"] is None
    # really data parallel: accelerate's CPU multi-process mode, the model wrapped in DDP (gradients averaged)
    assert report["distributed_type"] == "MULTI_CPU" and report["ddp_wrapped"], report
    # the save from the DDP-wrapped model: every file beside the weights as save_pretrained writes it, and it reloads
    final = tmp_path / "out" / "final"
    trained = torch.tensor(json.loads((tmp_path / "out" / "probes_final.json").read_text()))
    assert torch.allclose(reloaded_outputs([final], "dpo")[final], trained, atol=1e-5, rtol=0)
