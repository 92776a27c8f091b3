"""GRPO and RLOO against a real, colocated vLLM (vllm-cpu 0.31, .ci/vllm.sh): the weight sync lands and is proven.

GRPO: one process with full fine-tuning, 2 processes with LoRA under ZeRO-3 and under FSDP2; RLOO: one process with
LoRA. Each run (tests/scripts/grpo_vllm.py) starts its own vLLM in its training processes and trains 3 steps, checking
every sync (vLLM's prompt log-probabilities against the trainer's, 1e-3), then saves, syncs once more and records vLLM's
log-probabilities. Here, in a fresh process with plain transformers and peft, the saved model gives vLLM's numbers
within 1e-3, and the untrained model does not. The runs are module-scoped: each starts vLLM once for all its checks.

Three runs break the second sync on purpose: one sends a stale ``lm_head.weight`` (a broken walk), one streams the
weights without loading them (vLLM keeps its old ones, as trl#5312's sleep mode did), in one process and under
2-process ZeRO-3. Each stops with a SyncError that names the tensors, on every rank.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import SCRIPTS, accelerate_launch, run_command, write_accelerate_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm")

ATOL = 1e-3
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def _run(tmp_path_factory, name: str, *args: str, backend: str | None = None) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp(name)
    script_args = ["--output_dir", str(out / "run"), *args]
    if backend:
        result = accelerate_launch(SCRIPTS / "grpo_vllm.py", script_args,
                                   write_accelerate_config(out / "configs", backend), timeout=600, env=ENV)
    else:
        result = run_command([sys.executable, str(SCRIPTS / "grpo_vllm.py"), *script_args], timeout=600, env=ENV)
    assert result.returncode == 0 and not result.timed_out, result.output[-6000:]
    return json.loads((out / "run" / "report_rank0.json").read_text()), str(out / "run")


@pytest.fixture(scope="module")
def full_one_process(tmp_path_factory):
    return _run(tmp_path_factory, "full", "--trainer", "grpo")


@pytest.fixture(scope="module")
def lora_zero3(tmp_path_factory):
    return _run(tmp_path_factory, "lora-zero3", "--trainer", "grpo", "--lora", backend="zero3")


@pytest.fixture(scope="module")
def lora_fsdp2(tmp_path_factory):
    return _run(tmp_path_factory, "lora-fsdp2", "--trainer", "grpo", "--lora", backend="fsdp2")


@pytest.fixture(scope="module")
def rloo_lora(tmp_path_factory):
    return _run(tmp_path_factory, "rloo", "--trainer", "rloo", "--lora", "--check_every", "2")


def saved_logprobs(run: str, lora: bool, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The saved model's and the untrained model's log-probabilities of ``tokens``, with plain transformers/peft."""
    from transformers import AutoModelForCausalLM

    from trl_ext.assets import vllm_model_path
    from trl_ext.trainers.sync_check import trainer_logprobs

    untrained = AutoModelForCausalLM.from_pretrained(vllm_model_path(), dtype=torch.float32)
    before = trainer_logprobs(untrained, tokens, "cpu")
    if lora:
        from peft import PeftModel

        saved = PeftModel.from_pretrained(untrained, f"{run}/final").merge_and_unload()
    else:
        saved = AutoModelForCausalLM.from_pretrained(f"{run}/final", dtype=torch.float32)
    return trainer_logprobs(saved, tokens, "cpu"), before


def assert_vllm_serves_the_saved_model(report: dict, run: str, lora: bool) -> None:
    engine = torch.tensor(report["engine_logprobs"], dtype=torch.float64)
    saved, untrained = saved_logprobs(run, lora, report["tokens"])
    assert (engine - saved).abs().max() <= ATOL, (engine - saved).abs().max()
    assert (engine - untrained).abs().max() > 10 * ATOL, "training did not move the weights vLLM serves"


@pytest.mark.parametrize("case", ["full_one_process", "lora_zero3", "lora_fsdp2"])
def test_grpo_colocated_vllm_serves_the_saved_model_after_training(case, request):
    report, run = request.getfixturevalue(case)
    assert report["engine_dtype"] == "torch.float32"  # trl_ext's vllm-cpu-dtype: the trainer's dtype, not bf16
    assert report["global_step"] == 3 and report.get("error") is None
    assert_vllm_serves_the_saved_model(report, run, lora=case != "full_one_process")


def test_every_sync_is_checked_where_it_can_be(full_one_process, lora_zero3, lora_fsdp2):
    # 3 steps: a sync before each, plus the one after training; all checked (one process, FSDP2)
    for report, _ in (full_one_process, lora_fsdp2):
        assert report["syncs"] == 4 and len(report["check_seconds"]) == 4
    # ZeRO-3: the first check waits for the process's second sync (weight_sync._can_check)
    assert lora_zero3[0]["syncs"] == 4 and len(lora_zero3[0]["check_seconds"]) == 3


def test_rloo_colocated_vllm_checks_every_second_sync(rloo_lora):
    report, run = rloo_lora
    assert report["global_step"] == 3 and report["syncs"] == 4
    assert len(report["check_seconds"]) == 3  # syncs 1 and 3, and the one after training (always checked here)
    assert_vllm_serves_the_saved_model(report, run, lora=True)


@pytest.mark.parametrize("fault, named, why", [
    ("sent-stale", ["lm_head.weight"], "the values sent differ from the trainer's weights"),
    ("not-applied", ["lm_head.weight", "model.layers.0.self_attn.q_proj.weight"], "vLLM did not apply them"),
])
def test_a_sync_that_did_not_land_stops_training_naming_the_tensors(fault, named, why, tmp_path_factory):
    report, _ = _run(tmp_path_factory, fault, "--trainer", "grpo", "--fault", fault)
    assert report["kind"] == "sync" and report["global_step"] == 1, report  # stopped at the second sync
    assert "did not land at training step 2" in report["error"] and why in report["error"], report["error"]
    for name in named:
        assert name in report["error"], report["error"]
    assert report["detail"] == named[0] or fault == "not-applied"


DEFAULT_DTYPE = """
from vllm import LLM
from trl_ext.assets import vllm_model_path
llm = LLM(model=vllm_model_path(), distributed_executor_backend="external_launcher", enforce_eager=True)
print("engine dtype:", llm.llm_engine.model_config.dtype, flush=True)
import os; os._exit(0)
"""


def test_vllm_cpu_runs_an_fp32_checkpoint_in_bf16_unless_told():
    """Why trl_ext's ``vllm-cpu-dtype`` patch exists: built as TRL builds it (no dtype), the colocated engine runs the
    fp32 checkpoint in bf16 while the trainer trains fp32; the first sync check then differs by about 3e-3."""
    env = {**ENV, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    result = run_command([sys.executable, "-c", DEFAULT_DTYPE], timeout=300, env=env)
    assert result.returncode == 0, result.output[-4000:]
    assert "engine dtype: torch.bfloat16" in result.output, "vLLM keeps fp32 now: the patch can go"


def test_under_zero3_every_rank_stops_together_naming_the_tensors(tmp_path_factory):
    """Each rank checks its own engine; the ranks agree on the largest difference, so they stop together."""
    report, run = _run(tmp_path_factory, "not-applied-zero3", "--trainer", "grpo", "--lora", "--fault", "not-applied",
                       backend="zero3")
    other = json.loads((Path(run) / "report_rank1.json").read_text())
    for rank in (report, other):
        assert rank["kind"] == "sync" and rank["global_step"] == 1, rank
        assert "did not land at training step 2" in rank["error"] and "lm_head.weight" in rank["error"]
    assert report["error"] == other["error"]


def test_the_recipe_under_zero3_with_a_colocated_vllm_ends_by_itself(tmp_path):
    """The recipe as its docstring runs it, left to end as a user's run ends (``announce_done``, not a test script's
    exit): a colocated vLLM leaves idle thread pools, and a rank that joined their workers before concurrent.futures'
    exit hook told them to stop hung after "saved and verified" (seen three times before process.exit_now)."""
    result = run_command([sys.executable, "recipes/grpo.py", "--config", "accelerate_configs/zero3.yaml",
                          "--model_name_or_path", "trl-ext/tiny-llama-vllm", "--use_vllm", "true", "--vllm_mode",
                          "colocate", "--max_steps", "2", "--output_dir", str(tmp_path / "grpo")], timeout=400, env=ENV)
    assert not result.timed_out and result.returncode == 0, result.output[-6000:]
    assert f"GRPO model saved and verified: {tmp_path / 'grpo'}" in result.output, result.output[-6000:]
    assert "Traceback" not in result.output, result.output[-6000:]
