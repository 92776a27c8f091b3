"""TRL's training options under 2-process ZeRO-3 and FSDP2, with trl_ext's guarantees: each trains (LoRA, 2 steps,
a checkpoint at step 2), checkpoints every decoder layer non-reentrantly, and its final save and checkpoint-2 reload
in a fresh process with plain transformers + peft to the trained model's outputs, every file beside the weights as
``save_pretrained`` writes it. One launch per engine (``run_many.py``); one process, side by side with TRL, is
``tests/test_formats.py``.
"""

import json

import pytest
import torch

from tests import reloading
from trl_ext.assets import default_model_path
from trl_ext.files.audit import audit

pytestmark = pytest.mark.slow

COMMON = ["--lora", "--max_steps", "2", "--save_steps", "2", "--save_model", "final", "--rows", "32"]
OPTIONS = {
    "sft-padding-free": ("sft", "text", {"padding_free": True, "max_length": None}),
    "sft-packing-bfd": ("sft", "text", {"packing": True, "packing_strategy": "bfd", "max_length": 16}),
    "sft-packing-bfd-split": ("sft", "text", {"packing": True, "packing_strategy": "bfd_split", "max_length": 8}),
    "sft-packing-wrapped": ("sft", "text", {"packing": True, "packing_strategy": "wrapped", "max_length": 16}),
    "sft-completion-only-loss": ("sft", "prompt-completion", {"completion_only_loss": True}),
    "sft-assistant-only-loss": ("sft", None, {"assistant_only_loss": True}),
    "sft-loss-type-dft": ("sft", None, {"loss_type": "dft"}),
    "dpo-loss-type-list": ("dpo", None, {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}),
    "dpo-padding-free": ("dpo", None, {"padding_free": True}),
}
ENGINES = ["zero3", "fsdp2"]
ATOL = 1e-5


def _args(option: str) -> list[str]:
    trainer, data, config = OPTIONS[option]
    return ["--trainer", trainer, *(["--data", data] if data else []), "--config_json", json.dumps(config), *COMMON]


@pytest.fixture(scope="module", params=ENGINES)
def engine_runs(request, shared_runs):
    """``(engine, {option: output directory}, {checkpoint path: reloaded outputs})``: one launch, one reload."""
    runs = [_args(option) for option in OPTIONS]
    shared_runs.many("train.py", request.param, runs)
    outs = {option: shared_runs.get("train.py", request.param, args) for option, args in zip(OPTIONS, runs)}
    checkpoints = [str(p) for out in outs.values() for p in (out / "final", out / "checkpoint-2")]
    return request.param, outs, reloading.reload(default_model_path(), "causal", checkpoints, timeout=600)


@pytest.mark.parametrize("option", OPTIONS)
def test_option_trains_checkpoints_non_reentrantly_and_reloads(engine_runs, option):
    engine, outs, reloaded = engine_runs
    out = outs[option]
    report = json.loads((out / "report_rank0.json").read_text())
    assert report["world_size"] == 2 and report["global_step"] == 2
    if engine == "zero3":
        assert report["partition"]["num_partitioned"] == report["partition"]["num_params"]
    else:
        dtensors, _, total = report["fsdp_sharded"]
        assert dtensors == total
    assert all(torch.isfinite(torch.tensor(report["losses"])))
    layers = report["checkpointing"]["layers"]
    assert len(layers) == 2 and set(layers.values()) == {False}, layers  # every decoder layer, non-reentrant
    trained = torch.tensor(json.loads((out / "probes_final.json").read_text()))
    for name in ("final", "checkpoint-2"):  # checkpoint-2 is the last step: the same weights as the final save
        path = str(out / name)
        assert not reloaded["metadata"][path], reloaded["metadata"][path]
        assert (torch.tensor(reloaded["outputs"][path]) - trained).abs().max().item() <= ATOL
        assert audit(path, base=default_model_path()).ok
