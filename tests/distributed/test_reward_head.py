"""Reward models under 2-process ZeRO-3: the head initialised sanely under zero.Init, trained whole even with
the report-F2 PEFT config, saved, and reloaded in a fresh process with the trained rewards."""

import json

import pytest
import torch

from tests.distributed.conftest import REWARD_ALL_LINEAR_ROUNDTRIP
from tests.distributed.test_saving import assert_reload_identically, recorded, reloaded_outputs
from trl_ext.files.audit import audit

pytestmark = pytest.mark.slow

INITIALIZER_RANGE = 0.02  # the embedded model's config.initializer_range


def assert_head_initialised(head: dict) -> None:
    assert head["shape"] == [1, 64], head
    assert head["finite"] and head["zeros"] == 0, head
    assert 0.5 * INITIALIZER_RANGE < head["std"] < 1.5 * INITIALIZER_RANGE, head


def test_lora_all_linear_without_task_type(roundtrip):
    out = roundtrip("zero3", "reward", *REWARD_ALL_LINEAR_ROUNDTRIP)  # shared with test_merge
    report = json.loads((out / "report.json").read_text())
    assert report["partitioned"]
    assert report["head_at_init"]["name"].endswith("score.modules_to_save.default.weight")
    assert_head_initialised(report["head_at_init"])

    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and "score" in config["modules_to_save"]
    # base + PeftModel.from_pretrained, and AutoPeftModelForSequenceClassification: the trained rewards
    assert_reload_identically(out, ["checkpoint-2", "checkpoint-4", "final"], "reward")
    auto = reloaded_outputs([out / "final"], "reward-autopeft")[out / "final"]
    assert torch.allclose(auto, recorded(out, "final"), atol=1e-5, rtol=0)


def test_full_fine_tune(roundtrip):
    out = roundtrip("zero3", "reward")
    report = json.loads((out / "report.json").read_text())
    assert report["head_at_init"]["partitioned"], "zero.Init did not partition the head: the test proves nothing"
    assert_head_initialised(report["head_at_init"])

    config = json.loads((out / "final" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    assert_reload_identically(out, ["final"], "reward")
    if report["partitioned"]:  # a plain save_pretrained is refused, or (params gathered) writes a sound model
        assert "trainer.save_model(output_dir)" in report["user_save_pretrained"]
    else:
        assert audit(str(out / "user_save_pretrained")).ok
