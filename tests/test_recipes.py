"""The recipes as users run them, end to end in subprocesses: one process, and under ZeRO-3 on 2 CPU processes in the
headline form `accelerate launch recipes/X.py --config accelerate_configs/zero3.yaml`."""

import json
import re
import shutil
import sys

import pytest
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from tests import deepspeed_op
from tests.harness import run_command
from trl_ext.assets import arith_model_path, default_model_path
from trl_ext.files.audit import audit

SHORT = ["--max_steps", "4", "--eval_steps", "2", "--logging_steps", "2", "--per_device_eval_batch_size", "64"]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]

pytestmark = pytest.mark.slow  # every test starts recipe processes


def run_recipe(name, *args, timeout=300):
    cmd = [sys.executable, f"recipes/{name}.py", "--config", f"recipes/configs/{name}.yaml", *args]
    return run_command(cmd, timeout)


def assert_trained_and_saved(result, out, name):
    assert not result.timed_out and result.returncode == 0, result.output[-6000:]
    assert f"saved and verified: {out}" in result.output
    before_after = re.search(r"held-out eval, before -> after training: eval_loss ([\d.]+) -> ([\d.]+)", result.output)
    assert before_after, result.output[-3000:]
    assert list((out / "runs").rglob("events.out.tfevents.*")), "no TensorBoard logs"
    report = audit(str(out), base=arith_model_path() if name == "dpo" else default_model_path())
    assert report.ok, report.format()
    if name == "dpo":  # the DPO config ends on answers: held-out sums before -> after, and the try-it reply
        accuracy = re.search(r"held-out accuracy \(greedy\), before -> after training: ([\d.]+) -> ([\d.]+) \(120 ",
                             result.output)
        assert accuracy and all(0 <= float(a) <= 1 for a in accuracy.groups()), result.output[-3000:]
        assert re.search(r"^\[trl_ext\] it prints: \[\{'generated_text': '.*'\}\]$", result.output, re.M)
    if (out / "adapter_config.json").exists():
        assert f"trl-ext merge --adapter {out}" in result.output
    elif name == "reward":
        assert AutoModelForSequenceClassification.from_pretrained(out).config.num_labels == 1
    else:
        AutoModelForCausalLM.from_pretrained(out)


# The one-process SFT run logs every step and checkpoints every 2: the resume test continues a copy of it.
SFT_SAVES = ["--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "2"]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """``single_process(name)``: the output directory and result of the recipe's one-process run, made once."""
    made = {}

    def run(name: str):
        if name not in made:
            out = tmp_path_factory.mktemp("single") / name
            made[name] = out, run_recipe(name, "--output_dir", str(out), *SHORT, *(SFT_SAVES if name == "sft" else []))
        return made[name]

    return run


@pytest.mark.parametrize("name", ["sft", "reward", "dpo"])
def test_recipe_single_process(name, single_process):
    out, result = single_process(name)
    assert_trained_and_saved(result, out, name)
    assert "running under" not in result.output  # no accelerate config: no re-launch


# sft: both configs in one command; dpo: exactly the headline form; reward: accelerate's canonical form (its own
# --config_file before the recipe: no re-launch), LoRA with the F2 config
ZERO3_CASES = {
    "sft": [*ACCELERATE, "recipes/sft.py", "--config", "accelerate_configs/zero3.yaml", "--config",
            "recipes/configs/sft.yaml"],
    "reward": [*ACCELERATE, "--config_file", "accelerate_configs/zero3.yaml", "recipes/reward.py", "--config",
               "recipes/configs/reward.yaml", "--use_peft", "--lora_target_modules", "all-linear", "--lora_r", "4"],
    "dpo": [*ACCELERATE, "recipes/dpo.py", "--config", "accelerate_configs/zero3.yaml"],
}


@pytest.mark.parametrize("name", ["sft", "reward", "dpo"])
def test_recipe_as_written_under_zero3(name, tmp_path):
    out = tmp_path / name
    cmd = [*ZERO3_CASES[name], "--output_dir", str(out), *SHORT, "--save_strategy", "steps", "--save_steps", "4"]
    result = run_command(cmd, timeout=600, env={"HF_HOME": str(tmp_path / "hf")})  # no user accelerate default config
    assert_trained_and_saved(result, out, name)
    if name == "reward":  # launched by accelerate itself: the recipe runs as it is
        assert "running under" not in result.output
        assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    else:
        assert "running under accelerate_configs/zero3.yaml with 2 processes" in result.output
    assert "gloo backend" in result.output
    # DeepSpeed wrote ZeRO-3 (partitioned-parameter) states for 2 ranks: it really ran under ZeRO-3 on 2 processes
    states = sorted(p.name for p in (out / "checkpoint-4" / "global_step4").iterdir())
    assert [s for s in states if s.endswith("model_states.pt")] == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"], states


def test_resume_continues_where_it_stopped(single_process, tmp_path):
    first_out, first = single_process("sft")  # 4 steps, checkpoints at 2 and 4
    assert first.returncode == 0, first.output[-4000:]
    out = tmp_path / "sft"
    shutil.copytree(first_out, out)  # the shared run stays as it was
    first_log = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]

    args = ["--output_dir", str(out), "--eval_strategy", "no", *SFT_SAVES]
    second = run_recipe("sft", *args, "--max_steps", "6", "--resume_from_checkpoint", "true")
    assert second.returncode == 0, second.output[-4000:]
    assert f"resuming from {out / 'checkpoint-4'}" in second.output
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    losses = {e["step"]: e["loss"] for e in state["log_history"] if "loss" in e}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]  # steps 1-4 from the first run, 5-6 trained after the resume
    assert all(losses[e["step"]] == e["loss"] for e in first_log if "loss" in e)


def test_bad_input_is_one_line_before_anything_starts(tmp_path):
    """The script as a user runs it, with an accelerate config: the re-launched ranks check the input before any model
    loads; one line from the first, every process ends non-zero, nothing written (every other message of the recipes'
    checks: tests/test_bad_input.py, in-process, through the function the script calls)."""
    args = ["--config", "accelerate_configs/zero3.yaml", "--lora_rr", "8", "--output_dir", str(tmp_path / "out")]
    result = run_command([sys.executable, "recipes/dpo.py", *args], 300)
    assert result.returncode == 1, result.output[-2000:]
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "lora_rr (did you mean lora_r?)" in errors[0], result.output[-2000:]
    assert "Traceback" not in result.output, result.output[-3000:]
    assert not (tmp_path / "out").exists()


def test_recipe_refuses_to_train_over_another_run(tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"precious")
    result = run_recipe("dpo", "--output_dir", str(out), *SHORT)
    assert result.returncode != 0
    assert "already holds files" in result.output and "Traceback" not in result.output
    assert (out / "model.safetensors").read_bytes() == b"precious"
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


@pytest.mark.parametrize("config", ["ddp", "zero2", "zero2_offload", "zero3_offload"])
@pytest.mark.timeout(1800)  # the first offload case builds CPU Adam: 140 s alone, over 600 s under CI's load (measured)
def test_every_accelerate_config_trains(config, tmp_path):
    if "offload" in config:  # DeepSpeed's CPU Adam, built before the launch's timeout starts (tests/deepspeed_op.py)
        deepspeed_op.build(deepspeed_op.CPU_ADAM)
    out = tmp_path / config
    cmd = [*ACCELERATE, "recipes/sft.py", "--config", f"accelerate_configs/{config}.yaml", "--output_dir", str(out),
           "--max_steps", "2", "--eval_strategy", "no", "--logging_steps", "1"]
    result = run_command(cmd, timeout=600, env={"HF_HOME": str(tmp_path / "hf")})
    assert not result.timed_out and result.returncode == 0, result.output[-6000:]
    assert f"running under accelerate_configs/{config}.yaml with 2 processes" in result.output
    assert f"saved and verified: {out}" in result.output
    assert audit(str(out)).ok


def assert_vlm_trained_and_saved(result, out):
    assert not result.timed_out and result.returncode == 0, result.output[-6000:]
    assert f"saved and verified: {out}" in result.output
    assert re.search(r"held-out eval, before -> after training: eval_loss ([\d.]+) -> ([\d.]+)", result.output)
    assert "vision tower (" in result.output and ") is frozen" in result.output
    from trl_ext.assets import vlm_model_path

    report = audit(str(out), base=vlm_model_path())
    assert report.ok, report.format()


def test_vlm_dpo_recipe_single_process(tmp_path):
    out = tmp_path / "dpo_vlm"
    cmd = [sys.executable, "recipes/dpo.py", "--config", "recipes/configs/dpo_vlm.yaml", "--output_dir", str(out),
           *SHORT]
    assert_vlm_trained_and_saved(run_command(cmd, 300), out)
    assert json.loads((out / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head"]


def test_vlm_sft_recipe_as_written_under_zero3_and_its_try_it_line(tmp_path):
    out = tmp_path / "sft_vlm"
    cmd = [*ACCELERATE, "recipes/sft.py", "--config", "accelerate_configs/zero3.yaml", "--config",
           "recipes/configs/sft_vlm.yaml", "--output_dir", str(out), *SHORT]
    result = run_command(cmd, timeout=600, env={"HF_HOME": str(tmp_path / "hf")})
    assert_vlm_trained_and_saved(result, out)
    assert "running under accelerate_configs/zero3.yaml with 2 processes" in result.output
    # the printed command answers a question about a shapes image with the saved adapter
    (line,) = [ln for ln in result.output.splitlines() if ln.startswith("[trl_ext] try it: python -c ")]
    command = line.removeprefix("[trl_ext] try it: python -c ").strip('"')
    tried = run_command([sys.executable, "-c", command], timeout=120)
    assert tried.returncode == 0 and "'generated_text'" in tried.output, tried.output[-3000:]


def test_grpo_recipe_single_process(tmp_path):
    """The GRPO recipe on its tiny config, a few steps: it trains, saves a verified model that reloads, and prints
    held-out accuracy, sampled and greedy, before and after. Learning itself is not asserted: the config's full run
    takes minutes (its measured numbers are in the config and docs/grpo.md)."""
    out = tmp_path / "grpo"
    result = run_recipe("grpo", "--output_dir", str(out), "--max_steps", "3", "--logging_steps", "1")
    assert not result.timed_out and result.returncode == 0, result.output[-6000:]
    assert f"GRPO model saved and verified: {out}" in result.output
    accuracy = dict(re.findall(r"held-out accuracy \((sampled|greedy)\b[^)]*\), before -> after training: "
                               r"(\d\.\d{3} -> \d\.\d{3})", result.output))
    assert accuracy.keys() == {"sampled", "greedy"}, result.output[-3000:]
    assert all(0 <= float(a) <= 1 for line in accuracy.values() for a in line.split(" -> ")), accuracy
    rewards = re.findall(r"'reward': '([\d.e-]+)'", result.output)
    assert len(rewards) == 3, result.output[-3000:]  # one logged mean reward per step
    assert list((out / "runs").rglob("events.out.tfevents.*")), "no TensorBoard logs"
    report = audit(str(out), base=arith_model_path())  # the config starts from the warmed model
    assert report.ok, report.format()
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(arith_model_path())
    changed = [n for n, p in reloaded.state_dict().items() if not p.equal(base.state_dict()[n])]
    assert changed, "the saved model must hold the trained weights, not the base's"
