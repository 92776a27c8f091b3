"""FSDP2 with the guarantees ZeRO-3 has: 2 CPU processes (gloo), ``fully_shard`` through accelerate's FSDP path.

Every save (final and checkpoint-N, adapters, full models, the reward head) is streamed from the DTensor shards to
one writer, reloads with plain transformers/peft to the trained model's outputs, and keeps the optimizer states
sharded (DCP). A kill during a save costs nothing already saved, and the resumed run equals the uninterrupted one.
TRL's own ``fsdp2.yaml`` runs unchanged (only ``--num_processes``), and so do ours, through the recipes. With
``fsdp_cpu_ram_efficient_loading`` only rank 0 reads the weights, and training is exactly what it is without it.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
import trl
from safetensors.torch import load_file

from tests import reloading
from tests.distributed.test_reliability import assert_fault_cost_nothing, digest, logged, max_diff
from tests.harness import REPO, SCRIPTS, accelerate_launch, run_command
from trl_ext.assets import default_model_path
from trl_ext.files.audit import audit

pytestmark = pytest.mark.slow

ATOL = 1e-5  # fp32 on CPU
TRL_FSDP2 = Path(trl.__file__).parent / "accelerate_configs" / "fsdp2.yaml"  # as shipped: bf16, FULL_STATE_DICT
OURS = REPO / "accelerate_configs"


def train(out: Path, config: Path, *args: str):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2",
           "--main_process_port", "0", str(SCRIPTS / "train.py"), "--output_dir", str(out), *args]
    return run_command(cmd, timeout=300)


def reloaded(kind: str, *checkpoints: Path) -> dict[str, torch.Tensor]:
    """Probe outputs of each checkpoint, loaded in a fresh process with plain transformers + peft, after asserting
    that every file beside the weights is what ``save_pretrained`` writes (``architectures`` names the model's class,
    not FSDP2's ``FSDP<Class>`` wrapper)."""
    found = reloading.reload(default_model_path(), kind, checkpoints)
    assert not any(found["metadata"].values()), found["metadata"]
    return {Path(k).name: torch.tensor(v) for k, v in found["outputs"].items()}


def assert_sharded_and_saved(out: Path, kind: str) -> None:
    report = json.loads((out / "report_rank0.json").read_text())
    assert report["distributed_type"] == "FSDP" and report["world_size"] == 2
    dtensors, partial, total = report["fsdp_sharded"]  # a 1-row head is all on rank 0 (torch.chunk), none on rank 1
    assert dtensors == total and partial >= total - 2, report["fsdp_sharded"]
    trained = torch.tensor(json.loads((out / "probes_final.json").read_text()))
    checkpoints = sorted(out.glob("checkpoint-*"))
    for name, outputs in reloaded(kind, out / "final", *checkpoints).items():
        assert (outputs - trained).abs().max().item() <= ATOL if name in ("final", checkpoints[-1].name) else True
    for checkpoint in [out / "final", *checkpoints]:
        assert audit(str(checkpoint), base=default_model_path()).ok
    for checkpoint in checkpoints:  # optimizer states sharded by DCP, one file per rank; no whole-model copies
        names = sorted(p.name for p in checkpoint.iterdir())
        assert not [n for n in names if n.startswith(("pytorch_model_fsdp", "optimizer.bin"))], names
        assert sorted(p.name for p in (checkpoint / "optimizer_0").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_trl_fsdp2_config_full_sft_saves_reloads_and_resumes_after_a_kill_mid_save(tmp_path):
    """TRL's shipped fsdp2.yaml, unchanged: bf16 falls back to fp32 on CPU, FULL_STATE_DICT still saves sharded.
    Full fine-tuning, so resume loads every weight (each rank its own rows of the Hub-format file)."""
    args = ["--trainer", "sft", "--max_steps", "4", "--save_steps", "2"]
    reference = train(tmp_path / "reference", TRL_FSDP2, *args, "--save_model", "final")
    assert reference.returncode == 0, reference.output[-6000:]
    assert "bf16 is not supported on this hardware" in reference.output
    assert_sharded_and_saved(tmp_path / "reference", "causal")

    out = tmp_path / "run"
    fault = ["--kill_during_save", "4"]
    faulty = train(out, TRL_FSDP2, *args, *fault)
    assert not faulty.timed_out and faulty.returncode != 0, faulty.output[-4000:]
    assert_fault_cost_nothing(out, tmp_path / "reference", fault)
    before = digest(out / "checkpoint-2")

    resumed = train(out, TRL_FSDP2, *args, "--resume")
    assert resumed.returncode == 0, resumed.output[-6000:]
    ref, got = (json.loads((d / "report_rank0.json").read_text()) for d in (tmp_path / "reference", out))
    assert got["steps_run_here"] == 2 and got["global_step"] == 4
    assert got["scheduler"] == ref["scheduler"] and got["optimizer_steps"] == ref["optimizer_steps"] == [4.0]
    assert [h["loss"] for h in logged(out)] == pytest.approx([h["loss"] for h in logged(tmp_path / "reference")],
                                                              abs=ATOL)
    diffs = {"weights": max_diff(*(load_file(d / "trained.safetensors") for d in (tmp_path / "reference", out)))}
    for rank in (0, 1):
        diffs[f"adam_rank{rank}"] = max_diff(*(load_file(d / f"optimizer_rank{rank}.safetensors")
                                              for d in (tmp_path / "reference", out)))
    assert all(d <= ATOL for d in diffs.values()), diffs
    assert digest(out / "checkpoint-2") == before, "resuming changed the checkpoint it resumed from"


# trainer, training args, probe kind, accelerate config
CASES = {
    "dpo-lora": ("dpo", ["--lora"], "causal", "fsdp2.yaml"),
    # the score head, trained and saved whole; FSDP's own activation checkpointing instead of ours
    "reward-lora-fsdp-checkpointing": ("reward", ["--lora"], "reward", "fsdp2.yaml"),
    "sft-lora-offload": ("sft", ["--lora"], "causal", "fsdp2_offload.yaml"),
}
SHIPPED_CONFIG_CASE = "dpo-lora"  # with fsdp2.yaml as shipped: a run of the loading test's launch


def saves_args(case: str) -> list[str]:
    trainer, args, _, _ = CASES[case]
    return ["--trainer", trainer, *args, "--max_steps", "2", "--save_steps", "2", "--save_model", "final"]


@pytest.mark.parametrize("case", CASES)
def test_fsdp2_saves_reload_to_the_trained_outputs(tmp_path, case, request):
    _, _, kind, config = CASES[case]
    if case == SHIPPED_CONFIG_CASE:  # made in the loading test's launch with fsdp2.yaml as shipped
        out, output = request.getfixturevalue("loading") / "saves" / case, None
    else:
        out, config = tmp_path, OURS / config
        if "fsdp-checkpointing" in case:
            config = tmp_path / "fsdp2_ac.yaml"
            config.write_text((OURS / "fsdp2.yaml").read_text().replace("fsdp_activation_checkpointing: false",
                                                                         "fsdp_activation_checkpointing: true"))
        result = train(tmp_path, config, *saves_args(case))
        assert result.returncode == 0, result.output[-6000:]
        output = result.output
    assert_sharded_and_saved(out, kind)
    layers = json.loads((out / "report_rank0.json").read_text())["checkpointing"]["layers"]
    if "fsdp-checkpointing" in case:  # FsdpCheckpointingCheck verified FSDP's wrappers at train start
        assert "gradient_checkpointing is turned off" in output and layers == {}
    else:  # ours: every layer non-reentrant (CheckpointingPolicy verified it at train start too)
        assert layers and set(layers.values()) == {False}, layers


def test_dpo_recipe_as_written_under_fsdp2(tmp_path):
    """The headline command with fsdp2.yaml: full fine-tuning with TRL's reference model, both sharded."""
    from tests.test_recipes import ACCELERATE, SHORT, assert_trained_and_saved

    out = tmp_path / "dpo"
    cmd = [*ACCELERATE, "recipes/dpo.py", "--config", "accelerate_configs/fsdp2.yaml", "--output_dir", str(out),
           *SHORT, "--save_strategy", "steps", "--save_steps", "4"]
    result = run_command(cmd, timeout=600, env={"HF_HOME": str(tmp_path / "hf")})
    assert_trained_and_saved(result, out, "dpo")
    assert "running under accelerate_configs/fsdp2.yaml with 2 processes" in result.output
    assert sorted(p.name for p in (out / "checkpoint-4" / "optimizer_0").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]


# name -> train.py arguments: each trainer, full and LoRA; "dpo" is the full fine-tune with TRL's reference model
LOADING_RUNS = {f"{trainer}{'-lora' * lora}": ["--trainer", trainer, *(["--lora"] * lora), "--max_steps", "2",
                                               "--rows", "8", "--record_loading"]
                for trainer in ("sft", "reward", "dpo") for lora in (False, True)}
TIMING = ("train_runtime", "train_samples_per_second", "train_steps_per_second")


@pytest.fixture(scope="module")
def loading(tmp_path_factory) -> Path:
    """One launch per setting of ``fsdp_cpu_ram_efficient_loading`` runs the six loading cases, each in
    ``<setting>/<name>``; the "true" one (fsdp2.yaml as shipped) also runs the saves test's SHIPPED_CONFIG_CASE, in
    ``saves/<case>``."""
    tmp = tmp_path_factory.mktemp("fsdp2-loading")
    for flag in ("true", "false"):
        config = tmp / f"fsdp2-{flag}.yaml"
        config.write_text((OURS / "fsdp2.yaml").read_text().replace("fsdp_cpu_ram_efficient_loading: true",
                                                                    f"fsdp_cpu_ram_efficient_loading: {flag}"))
        argvs = [[*args, "--output_dir", str(tmp / flag / name)] for name, args in LOADING_RUNS.items()]
        if flag == "true":
            argvs.append([*saves_args(SHIPPED_CONFIG_CASE), "--output_dir", str(tmp / "saves" / SHIPPED_CONFIG_CASE)])
        result = accelerate_launch(SCRIPTS / "run_many.py", ["train.py", json.dumps(argvs)], config, timeout=600)
        assert not result.timed_out and result.returncode == 0, result.output[-6000:]
    return tmp


def test_cpu_ram_efficient_loading_rank1_reads_no_weights_and_trains_the_same(loading):
    """fsdp2.yaml's ``fsdp_cpu_ram_efficient_loading: true``: rank 1 reads not one byte of the weight files (it
    receives rank 0's), and every run ends exactly as with the flag off: same logs, same trained weights, and DPO's
    reference model holds exactly the checkpoint's weights. One launch per setting runs the six cases."""
    for name in LOADING_RUNS:
        on, off = loading / "true" / name, loading / "false" / name
        reads = {d: [sum(json.loads((d / f"weight_reads_rank{r}.json").read_text()).values()) for r in (0, 1)]
                 for d in (on, off)}
        assert reads[on][0] == reads[off][0] == reads[off][1] > 0 and reads[on][1] == 0, (name, reads)
        logs_on, logs_off = ([{k: v for k, v in h.items() if k not in TIMING} for h in
                              json.loads((d / "report_rank0.json").read_text())["log_history"]] for d in (on, off))
        assert logs_on == logs_off, name  # losses, grad norms and, for DPO, rewards against the reference model
        trained_on, trained_off = (load_file(d / "trained.safetensors") for d in (on, off))
        assert trained_on.keys() == trained_off.keys() and all(
            torch.equal(trained_on[k], trained_off[k]) for k in trained_on), name
    checkpoint = load_file(Path(default_model_path()) / "model.safetensors")
    reference = load_file(loading / "true" / "dpo" / "ref.safetensors")
    assert reference.keys() == checkpoint.keys() and all(torch.equal(reference[k], checkpoint[k]) for k in reference)
    dpo_reads = [sum(json.loads((loading / "true" / n / "weight_reads_rank0.json").read_text()).values())
                 for n in ("dpo", "dpo-lora")]
    assert dpo_reads[0] == 2 * dpo_reads[1]  # rank 0 read the policy and the reference model
