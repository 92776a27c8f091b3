"""Every model family saves in the Hub's own format, under real 2-process ZeRO-3 with parameters partitioned.

Twelve tiny families (dense, MoE, vision-language; see ``tests/families.py``) train SFT for two steps with LoRA and
with full fine-tuning, plus a reward model (dense LoRA, MoE full), DPO (MoE LoRA) and LoRA on a MoE's fused expert
tensors (PEFT ``target_parameters``): one launch for all runs
(``tests/scripts/family_train.py``). Each adapter is merged with ``trl-ext merge``. Then one fresh process with plain
transformers and peft (``tests/scripts/family_check.py``) checks every run:

1. the files hold exactly the names, shapes and dtypes that ``save_pretrained`` (PEFT's, for adapters) writes for
   the same weights, and every other file (``config.json`` field by field, with ``architectures[0]`` the class that
   transformers exports, ``generation_config.json``, ``adapter_config.json``, tokenizer files, the model card) is
   what ``save_pretrained`` writes;
2. ``from_pretrained`` gives the trained outputs;
3. ``iter_merged_weights`` (taken under ZeRO-3 during the run) equals the merged model's Hub-format state dict;
4. the ``trl-ext merge`` output is Hub format and gives the trained outputs;
and the model loaded partitioned under ``zero.Init`` gave the one-process outputs before any step, and each full
fine-tuning run resumed from ``checkpoint-1`` equals the uninterrupted run (under ZeRO-3, and in one process for the
families whose layout transformers converts).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.families import FAMILIES, family_path
from tests.harness import REPO, SCRIPTS, accelerate_launch, run_command, write_accelerate_config

pytestmark = pytest.mark.slow

RUNS = ([f"{family}:sft:{mode}" for mode in ("lora", "full") for family in FAMILIES]
        + ["llama:reward:lora", "qwen3_moe:reward:full", "qwen3_moe:dpo:lora", "qwen3_moe:sft:experts"])
ATOL = 1e-5  # fp32 on CPU; measured 0.0 for reloads and resumes, below 1e-6 for merges
ONE_PROCESS_RESUME = ["qwen3_moe", "mixtral", "qwen2_vl", "llava"]  # the families whose layout is converted


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        family_path(family)  # built once here, not by both ranks
    config = write_accelerate_config(out / "configs", "zero3")
    trained = accelerate_launch(SCRIPTS / "family_train.py",
                                ["--out", str(out), "--runs", ",".join(RUNS), "--resume_check"], config, timeout=600)
    assert trained.returncode == 0 and not trained.timed_out, trained.output[-6000:]

    specs = {run: check_spec(out, run) for run in RUNS}
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps({s["dir"]: s for s in specs.values()}))
    checked = subprocess.run([sys.executable, "-m", "tests.scripts.family_check", str(spec_file)], cwd=REPO,
                             capture_output=True, text=True, timeout=600, check=False)
    assert checked.returncode == 0, checked.stderr[-6000:]
    by_dir = json.loads(checked.stdout.strip().splitlines()[-1])
    reports = {run: json.loads((out / run.replace(":", "-") / "report.json").read_text()) for run in RUNS}
    return {run: {**by_dir[spec["dir"]], "partition": reports[run], "resume_diff": resume_diff(Path(spec["dir"]))}
            for run, spec in specs.items()}


def check_spec(out: Path, run: str) -> dict:
    """``family_check.py``'s spec for one run; an adapter is merged with ``trl-ext merge`` first."""
    from trl_ext import cli

    family, trainer, mode = run.split(":")
    directory = out / run.replace(":", "-")
    merged = None
    if mode != "full":
        merged = directory / "merged"
        assert cli.main(["merge", "--adapter", str(directory / "final"), "--out", str(merged)]) in (0, None)
    return {"dir": str(directory), "base": family_path(family), "model_class": FAMILIES[family][2], "mode": mode,
            "reward": trainer == "reward", "merged": str(merged) if merged else None}


def resume_diff(run: Path) -> float | None:
    """Outputs after resuming from checkpoint-1 vs the uninterrupted run's (full fine-tuning runs only)."""
    resumed = json.loads((run / "probes_resumed.json").read_text())
    if resumed is None:
        return None
    final = torch.tensor(json.loads((run / "probes_final.json").read_text()))
    return (torch.tensor(resumed) - final).abs().max().item()


# Under FSDP2 (TRL's fsdp2.yaml form, parameters as DTensor shards): one family of each kind and each way of training.
FSDP2_RUNS = ["llama:sft:full", "gemma3:sft:lora", "phi3:sft:lora", "mixtral:sft:full", "qwen3_moe:sft:full",
              "qwen3_moe:sft:experts", "qwen3_moe:reward:full", "qwen2_vl:sft:full", "llava:sft:lora",
              "gemma3_vlm:sft:lora"]


@pytest.fixture(scope="module")
def fsdp2_results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("families_fsdp2")
    for family in {run.split(":")[0] for run in FSDP2_RUNS}:
        family_path(family)
    config = write_accelerate_config(out / "configs", "fsdp2")
    # accelerate's DeepSpeed launcher puts the working directory on PYTHONPATH; its FSDP launcher does not
    trained = accelerate_launch(SCRIPTS / "family_train.py", ["--out", str(out), "--runs", ",".join(FSDP2_RUNS)],
                                config, timeout=600, env={"PYTHONPATH": str(REPO)})
    assert trained.returncode == 0 and not trained.timed_out, trained.output[-6000:]
    specs = {spec["dir"]: spec for spec in (check_spec(out, run) for run in FSDP2_RUNS)}
    (out / "spec.json").write_text(json.dumps(specs))
    checked = subprocess.run([sys.executable, "-m", "tests.scripts.family_check", str(out / "spec.json")], cwd=REPO,
                             capture_output=True, text=True, timeout=600, check=False)
    assert checked.returncode == 0, checked.stderr[-6000:]
    by_dir = json.loads(checked.stdout.strip().splitlines()[-1])
    return {run: {**by_dir[str(out / run.replace(":", "-"))],
                  "partition": json.loads((out / run.replace(":", "-") / "report.json").read_text())}
            for run in FSDP2_RUNS}


def assert_sharded_saved_and_reloaded(run: str, result: dict) -> None:
    """Checks 1-3 of the module docstring, and that every parameter was sharded (ZeRO-3 or FSDP2) while training."""
    print(run, result)
    partition = result["partition"]
    assert partition["num_partitioned"] == partition["num_params"], "not every parameter was sharded"
    assert result["files_as_save_pretrained"], "names, shapes or dtypes differ from what save_pretrained writes"
    assert not result["metadata"], f"files beside the weights differ from what save_pretrained writes: {result}"
    assert result["diff_final"] <= ATOL, "the reloaded model does not give the trained outputs"
    if "diff_loaded" in result:  # a reward base gets a random head at each load
        assert result["diff_loaded"] <= ATOL, "loaded sharded, the model differs from a one-process load"
    assert result["iter_equal"], f"iter_merged_weights differs from the Hub-format merged state dict: {result}"


@pytest.mark.parametrize("run", FSDP2_RUNS)
def test_family_under_fsdp2_saves_in_hub_format_and_reloads(fsdp2_results, run):
    """FSDP2's save streams the DTensor shards through the same Hub-format plan; iter_merged_weights unshards one FSDP
    unit at a time. LLaVA also checks the wrapping of the layer classes the model has (transformers >= 5.5 lists
    CLIPTextEmbeddings, which accelerate cannot find)."""
    result = fsdp2_results[run]
    assert_sharded_saved_and_reloaded(run, result)
    if not run.endswith(":full"):
        assert result["merge_as_save_pretrained"], "trl-ext merge did not write the Hub format"
        assert result["merge_diff"] <= ATOL, "the merged model does not give the trained outputs"


@pytest.mark.parametrize("family", ONE_PROCESS_RESUME)
def test_one_process_resume_of_a_converted_checkpoint_equals_uninterrupted(tmp_path_factory, family):
    """Trainer loads checkpoint-N by name; for converted layouts trl_ext loads it as from_pretrained does."""
    out = one_process_runs(tmp_path_factory)
    diff = resume_diff(out / f"{family}-sft-full")
    print(f"{family}: one-process resume vs uninterrupted, max|diff| {diff}")
    assert diff is not None and diff <= ATOL


_ONE_PROCESS: dict = {}


def one_process_runs(tmp_path_factory) -> Path:
    if "out" not in _ONE_PROCESS:  # one process for all families: start-up costs more than a run
        out = tmp_path_factory.mktemp("families_one_process")
        runs = ",".join(f"{family}:sft:full" for family in ONE_PROCESS_RESUME)
        result = run_command([sys.executable, "-m", "tests.scripts.family_train", "--out", str(out), "--runs", runs,
                              "--resume_check"], timeout=600)
        assert result.returncode == 0 and not result.timed_out, result.output[-6000:]
        _ONE_PROCESS["out"] = out
    return _ONE_PROCESS["out"]


@pytest.mark.parametrize("run", RUNS)
def test_family_saves_in_hub_format_and_reloads(results, run):
    result = results[run]
    assert_sharded_saved_and_reloaded(run, result)
    if not run.endswith(":full"):
        assert result["merge_as_save_pretrained"], "trl-ext merge did not write the Hub format"
        assert result["merge_diff"] <= ATOL, "the merged model does not give the trained outputs"
    else:  # a new trainer resumed from checkpoint-1 (DeepSpeed's states) and ran step 2 again
        assert result["resume_diff"] is not None and result["resume_diff"] <= ATOL, "resume differs from uninterrupted"
