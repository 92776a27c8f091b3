"""Merging adapters trained under 2-process ZeRO-3, and iter_merged_weights run inside such a run.

The runs are shared with test_saving (SFT) and test_reward_head (reward): ``roundtrip``, tests/distributed/conftest.py.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from tests.distributed.conftest import REWARD_ALL_LINEAR_ROUNDTRIP, SFT_LORA_ROUNDTRIP
from tests.distributed.test_saving import recorded, reloaded_outputs
from trl_ext.merge.in_memory import merge

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("trainer", ["sft", "reward"])
def test_merge_adapters_trained_under_zero3(roundtrip, trainer):
    out = roundtrip("zero3", trainer, *(REWARD_ALL_LINEAR_ROUNDTRIP if trainer == "reward" else SFT_LORA_ROUNDTRIP))
    report = json.loads((out / "report.json").read_text())
    assert report["partitioned"] and report["adapter_still_unmerged"]

    merge(str(out / "final"), str(out / "merged"))
    # plain from_pretrained on the merged directory: no num_labels, no PEFT
    got = reloaded_outputs([out / "merged"], "reward" if trainer == "reward" else "causal")[out / "merged"]
    assert torch.allclose(got, recorded(out, "final"), atol=1e-5, rtol=0)
    loader = AutoModelForSequenceClassification if trainer == "reward" else AutoModelForCausalLM
    merged = loader.from_pretrained(out / "merged")
    if trainer == "reward":
        assert merged.config.num_labels == 1

    # the weights streamed under ZeRO-3, under the base model's names, equal the merged model's
    streamed, expected = load_file(str(out / "iter_merged.safetensors")), merged.state_dict()
    assert set(streamed) == set(expected)
    for name, tensor in expected.items():
        assert torch.allclose(streamed[name], tensor, atol=1e-5), name
