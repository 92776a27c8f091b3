"""Resume anywhere: at any point of any epoch, and on another number of processes.

A resumed run must equal the uninterrupted one: the same samples in the same order (one id per trained row), the
same per-step losses, final weights and Adam state (its step count and each parameter group's hyperparameters too).
In one process: one uninterrupted run per data setting (``dataloader_drop_last`` off and on, packing), checkpointed
mid-epoch 0, exactly at an epoch boundary and in later epochs, then resumed from each checkpoint. Under ZeRO-3 and
under FSDP2: a 2-process run resumed from mid-epoch 0 on one process (2 -> 1, twice the gradient accumulation), and a
1-process run resumed from mid-epoch 1 on two (1 -> 2); LoRA, except ZeRO-3's 1 -> 2, a full fine-tuning with weight
decay (two parameter groups: the norms are not decayed). FSDP2's one-process side is a plain process (FSDP2 shards
across processes): its optimizer states are converted between the Trainer's whole file and DCP's shards.
Same-size ZeRO-3 resumes are in test_reliability.py and test_multinode.py.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import TrainerCallback

import trl_ext
from tests.harness import SCRIPTS, accelerate_launch, write_accelerate_config
from trl_ext.resuming import world_size

pytestmark = pytest.mark.slow

ROWS = [{"messages": [{"role": "user", "content": f"{i}+1?"}, {"role": "assistant", "content": f"{i + 1}"}]}
        for i in range(9)]  # 9 rows, batch 2: the last batch of an epoch is short unless dropped

# setting: config overrides, epochs, checkpoints to resume from (steps per epoch: 5, 4 with drop_last, 3 packed)
SETTINGS = {
    "drop_last-off": ({}, 3, [2, 5, 7, 12]),  # mid-epoch 0, epoch boundary, mid-epoch 1, mid-epoch 2
    "drop_last-on": ({"dataloader_drop_last": True}, 2, [4, 6]),
    "packing": ({"packing": True, "max_length": 32}, 2, [3, 4]),
}


class SaveAt(TrainerCallback):
    """Checkpoint exactly at the given optimizer steps."""

    def __init__(self, steps):
        self.steps = set(steps)

    def on_step_end(self, args, state, control, **kwargs):
        control.should_save = state.global_step in self.steps


def train(model_path, out: Path, overrides: dict, epochs: int, save_at=(), resume=None) -> dict:
    args = trl_ext.SFTConfig(output_dir=str(out), num_train_epochs=epochs, per_device_train_batch_size=2, seed=0,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", **overrides)
    trainer = trl_ext.SFTTrainer(model=model_path, args=args, train_dataset=Dataset.from_list(ROWS),
                                 peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
                                 callbacks=[SaveAt(save_at)])
    seen, step = [], trainer.training_step

    def recording_step(model, inputs, *a, **k):
        seen.append([hash(tuple(row.tolist())) for row in inputs["input_ids"]])
        return step(model, inputs, *a, **k)

    trainer.training_step = recording_step
    trainer.train(resume_from_checkpoint=resume)
    return {
        "seen": seen,
        "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
        "weights": {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad},
        "adam": [t.clone() for s in trainer.optimizer.state_dict()["state"].values() for t in s.values()],
        "lr": trainer.lr_scheduler.get_last_lr(),
        "global_step": trainer.state.global_step,
    }


@pytest.mark.parametrize("setting", SETTINGS)
def test_resume_at_any_point_of_any_epoch_equals_the_uninterrupted_run(tmp_path, tiny_model_path, setting):
    overrides, epochs, resume_at = SETTINGS[setting]
    ref = train(tiny_model_path, tmp_path / "ref", overrides, epochs, save_at=resume_at)
    steps_per_epoch = ref["global_step"] // epochs
    assert {"drop_last-off": 5, "drop_last-on": 4, "packing": 3}[setting] == steps_per_epoch
    assert sorted(set(map(len, ref["seen"]))) == ([1] if setting == "packing" else [1, 2] if setting ==
                                                  "drop_last-off" else [2])
    for step in resume_at:
        got = train(tiny_model_path, tmp_path / f"resumed-{step}", overrides, epochs,
                    resume=str(tmp_path / "ref" / f"checkpoint-{step}"))
        where = f"{setting}, resumed at step {step} (epoch {step / steps_per_epoch:.2f})"
        assert got["seen"] == ref["seen"][step:], f"{where}: another data order"  # one micro-batch per step
        assert got["global_step"] == ref["global_step"] and got["lr"] == ref["lr"], where
        assert {s: got["losses"][s] for s in got["losses"] if s > step} == {
            s: ref["losses"][s] for s in ref["losses"] if s > step}, where
        assert all(torch.equal(got["weights"][n], w) for n, w in ref["weights"].items()), where
        assert len(got["adam"]) == len(ref["adam"]) and all(map(torch.equal, got["adam"], ref["adam"])), where


# ---- ZeRO-3 on another number of processes ----------------------------------------------------------------------
# 12 rows, 2 per device, a global batch of 4 (2 processes, or 1 process with 2 accumulation steps): 3 steps an
# epoch, 6 steps, checkpoints at 2 (mid-epoch 0) and 4 (mid-epoch 1).
TRAIN = ["--trainer", "sft", "--rows", "12", "--max_steps", "6", "--save_steps", "2"]
LORA = ["--lora"]
# All parameters, in two groups with their own hyperparameters: DeepSpeed's ZeRO-3 universal loader (patch
# zero3-universal-load) shares one Adam step between them and gives both the first group's weight decay.
FULL = ["--config_json", json.dumps({"weight_decay": 0.1})]
# The same samples are summed in another order (one process accumulating two micro-batches vs two processes
# averaging gradients through gloo), so results differ by fp32 rounding: a few ulps of values of order 1 (losses,
# grad norms, Adam moments), amplified at most by 6 Adam steps of lr <= 1e-3. 1e-5 is ~100 ulps at 1.0 and far below
# one step's update (~1e-4 at lr 1e-4). Measured: 0.0 for 2 -> 1 and 1 -> 2 (gloo sums two values in one order).
ATOL = 1e-5


def run(tmp_path: Path, name: str, processes: int, *args: str, backend: str = "zero3") -> Path:
    if backend == "fsdp2" and processes == 1:
        backend = "ddp"  # one plain process
    config = write_accelerate_config(tmp_path / f"configs-{backend}{processes}", backend, num_processes=processes)
    out = tmp_path / name
    result = accelerate_launch(SCRIPTS / "train.py", [*TRAIN, "--output_dir", str(out), *args], config, timeout=400)
    assert result.returncode == 0 and not result.timed_out, result.output[-6000:]
    (out / "launch.log").write_text(result.output)
    return out


def compare(ref: Path, got: Path, resumed_at: int) -> dict:
    """Max abs differences resumed vs uninterrupted; asserts what must be exactly equal."""
    r, g = (json.loads((d / "report_rank0.json").read_text()) for d in (ref, got))
    assert g["global_step"] == r["global_step"] == 6 and g["steps_run_here"] == 6 - resumed_at
    assert g["scheduler"] == r["scheduler"]
    assert g["optimizer_steps"] == r["optimizer_steps"] == [6.0], "Adam's step count did not continue"
    assert g["optimizer_groups"] == r["optimizer_groups"], "another parameter group's hyperparameters"
    log_r, log_g = ([h for h in x["log_history"] if "loss" in h and h["step"] > resumed_at] for x in (r, g))
    assert [h["step"] for h in log_g] == [h["step"] for h in log_r] == list(range(resumed_at + 1, 7))
    assert [h["learning_rate"] for h in log_g] == [h["learning_rate"] for h in log_r]
    weights = [load_file(d / "trained.safetensors") for d in (ref, got)]
    adam = [load_file(d / "optimizer_full.safetensors") for d in (ref, got)]
    diffs = {"loss": max(abs(a["loss"] - b["loss"]) for a, b in zip(log_r, log_g)),
             "grad_norm": max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(log_r, log_g))}
    for what, (a, b) in (("weights", weights), ("adam", adam)):
        assert a.keys() == b.keys() and a
        diffs[what] = max((a[k] - b[k]).abs().max().item() for k in a)
    return diffs


def samples(out: Path, processes: int) -> list[list[int]]:
    """The samples of each optimizer step, over every rank: a step is one micro-batch per rank (2 processes) or
    two micro-batches of one rank (1 process)."""
    per_rank = [json.loads((out / f"seen_rank{r}.json").read_text()) for r in range(processes)]
    if processes == 2:
        return [sorted(a + b) for a, b in zip(*per_rank)]
    batches = per_rank[0]
    return [sorted(batches[i] + batches[i + 1]) for i in range(0, len(batches), 2)]


TWO_TO_ONE = "saved on 2 processes on 1: gradient_accumulation_steps 1 -> 2, to keep the global batch size of 4"
ONE_TO_TWO = "saved on 1 processes on 2: gradient_accumulation_steps 2 -> 1, to keep the global batch size of 4"


def assert_continues(ref: Path, got: Path, processes: tuple[int, int], step: int, notice: str, label: str) -> None:
    """The resumed run ``got`` (resumed at ``step``) said ``notice``, trained on the samples ``ref`` trained on after
    ``step``, and ended within ``ATOL`` of it; ``processes``: (ref's, got's)."""
    assert notice in (got / "launch.log").read_text()
    assert samples(got, processes[1]) == samples(ref, processes[0])[step:], \
        "the data did not continue at the next unseen sample"
    diffs = compare(ref, got, step)
    print(f"\n{label}: max abs diff {diffs}")
    assert all(d <= ATOL for d in diffs.values()), diffs


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero3")
    return tmp, run(tmp, "ref2", 2, *LORA)


def test_zero3_resume_on_one_process_equals_the_two_process_run(two_process_run):
    """2 -> 1 from mid-epoch 0, through the epoch boundary: universal checkpoint, accumulation 1 -> 2."""
    tmp, ref = two_process_run
    got = run(tmp, "two-to-one", 1, *LORA, "--resume_from", str(ref / "checkpoint-2"))
    assert_continues(ref, got, (2, 1), 2, TWO_TO_ONE, "2 -> 1 at step 2")
    # Converted once, beside the original, which is untouched; an unconvertible world size is refused first
    assert (ref / "checkpoint-2" / "global_step2_universal" / "zero").is_dir()
    assert (ref / "checkpoint-2" / "latest").read_text() == "global_step2"


def test_zero3_resume_on_two_processes_equals_the_one_process_run(two_process_run):
    """1 -> 2 from mid-epoch 1: a 1-process full fine-tuning with 2 accumulation steps, resumed on 2 processes
    with 1."""
    tmp, _ = two_process_run
    ref = run(tmp, "ref1", 1, *FULL, "--grad_accum", "2")
    assert len(json.loads((ref / "report_rank0.json").read_text())["optimizer_groups"]) == 2
    # the same command as the saved run's, on 2 processes
    got = run(tmp, "one-to-two", 2, *FULL, "--grad_accum", "2", "--resume_from", str(ref / "checkpoint-4"))
    assert_continues(ref, got, (1, 2), 4, ONE_TO_TWO, "full fine-tuning 1 -> 2 at step 4 (epoch 1.33)")


@pytest.fixture(scope="module")
def fsdp2_two_process_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2")
    return tmp, run(tmp, "ref2", 2, *LORA, backend="fsdp2")


def test_fsdp2_resume_on_one_process_equals_the_two_process_run(fsdp2_two_process_run):
    """2 -> 1 from mid-epoch 0: DCP's optimizer shards gathered into the one process, accumulation 1 -> 2."""
    tmp, ref = fsdp2_two_process_run
    assert (ref / "checkpoint-2" / "optimizer_0").is_dir() and not (ref / "checkpoint-2" / "optimizer.pt").exists()
    got = run(tmp, "two-to-one", 1, *LORA, "--resume_from", str(ref / "checkpoint-2"), backend="fsdp2")
    assert_continues(ref, got, (2, 1), 2, TWO_TO_ONE, "FSDP2 2 -> 1 at step 2")


def test_one_process_run_resumes_under_fsdp2_on_two_processes(fsdp2_two_process_run):
    """1 -> 2 from mid-epoch 1: the Trainer's whole optimizer file sharded into FSDP2's DTensors."""
    tmp, _ = fsdp2_two_process_run
    ref = run(tmp, "ref1", 1, *LORA, "--grad_accum", "2", backend="fsdp2")
    assert (ref / "checkpoint-4" / "optimizer.pt").is_file()
    got = run(tmp, "one-to-two", 2, *LORA, "--grad_accum", "2", "--resume_from", str(ref / "checkpoint-4"),
              backend="fsdp2")
    report = json.loads((got / "report_rank0.json").read_text())
    assert report["fsdp_sharded"][0] == report["fsdp_sharded"][2]  # every parameter a DTensor
    assert_continues(ref, got, (1, 2), 4, ONE_TO_TWO, "FSDP2 1 -> 2 at step 4 (epoch 1.33)")


class _Args:  # what read_reshard reads from TrainingArguments
    def __init__(self, world_size, per_device_train_batch_size):
        self.world_size, self.per_device_train_batch_size = world_size, per_device_train_batch_size


def test_a_global_batch_that_cannot_be_kept_is_refused_with_the_arithmetic(two_process_run, tmp_path):
    _, ref = two_process_run
    checkpoint = ref / "checkpoint-2"
    plan = world_size.read_reshard(checkpoint, _Args(1, 2))
    assert (plan.saved_world_size, plan.global_batch_size, plan.gradient_accumulation_steps) == (2, 4, 2)
    assert world_size.read_reshard(checkpoint, _Args(4, 1)).gradient_accumulation_steps == 1
    with pytest.raises(ValueError, match=r"global batch size of 4 samples \(saved on 2 processes\) on 3 processes x "
                                         r"per_device_train_batch_size 2 = 6 samples per micro-step"):
        world_size.read_reshard(checkpoint, _Args(3, 2))
    # A node-local copy (only rank 0's ZeRO states) resumes on the same 2 processes, and only there
    node_copy = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint, node_copy)
    for rank_file in (node_copy / "global_step2").glob("zero_pp_rank_1_*"):
        rank_file.unlink()
    assert world_size.read_reshard(node_copy, _Args(2, 2)).changed is False
    with pytest.raises(ValueError, match=r"holds the ZeRO states of 1 of the 2 processes that saved it \(node-local "
                                         r"storage\?\): resume on 2 processes"):
        world_size.read_reshard(node_copy, _Args(1, 2))
