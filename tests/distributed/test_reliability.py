"""A job that dies (preemption, OOM kill, a full disk, one rank lost) resumes as if it had never stopped.

Each case trains 4 steps on 2 processes under ZeRO-3 with a checkpoint every 2 steps, three times with the same
seed: uninterrupted (the shared ``zero3_run``, tests/distributed/conftest.py); interrupted after checkpoint-2 by a
fault; then resumed with ``resume_from_checkpoint=True``.
The resumed run must end with the uninterrupted run's weights, optimizer state (every rank's), scheduler step and
logged losses, and the fault must have cost nothing already saved. Driven through ``tests/scripts/train.py``.
"""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.trainer_utils import get_last_checkpoint

from tests.distributed.conftest import ZERO3_TRAIN
from tests.harness import SCRIPTS, accelerate_launch, hang_bound, write_accelerate_config
from trl_ext.assets import default_model_path
from trl_ext.files.audit import audit
from trl_ext.files.commit import PARTIAL_SUFFIX

pytestmark = pytest.mark.slow

ATOL = 1e-5  # fp32 on CPU: the same computation, split across two launches
TRAIN = ZERO3_TRAIN  # as the uninterrupted runs

# name: trainer, training args, the fault that stops the second run after checkpoint-2
CASES = {
    "sft-lora-every-rank-killed-mid-training": ("sft", ["--lora"], ["--kill_at_step", "3"]),
    "sft-full-every-rank-killed-mid-save": ("sft", [], ["--kill_during_save", "4"]),
    "dpo-lora-disk-full-during-save": ("dpo", ["--lora"], ["--fail_save", "4", "--fail_errno", "ENOSPC"]),
    "reward-lora-one-rank-killed": ("reward", ["--lora"], ["--kill_at_step", "3", "--kill_rank", "1"]),
}


def train(tmp_path: Path, trainer: str, out: str, *args: str):
    config = write_accelerate_config(tmp_path / "configs", "zero3")
    # The timeout is the hang detector: a run whose peer died must not wait out the 30-minute collective timeout.
    return accelerate_launch(SCRIPTS / "train.py",
                             ["--trainer", trainer, "--output_dir", str(tmp_path / out), *TRAIN, *args], config,
                             timeout=hang_bound(240))


def digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max().item() for k in a if a[k].numel()), default=0.0)


def logged(out: Path) -> list[dict]:
    history = json.loads((out / "report_rank0.json").read_text())["log_history"]
    return [{k: h[k] for k in ("step", "loss", "learning_rate", "grad_norm") if k in h} for h in history if "loss" in h]


def assert_resumed_equals_uninterrupted(reference: Path, out: Path, case: str, steps_run_here: int) -> None:
    """The run resumed in ``out`` ended as the uninterrupted ``reference`` (4 steps): the same step, schedule and
    optimizer step count, logged steps and learning rates, and within ATOL the logged losses and grad norms, the final
    weights and each rank's Adam states. ``steps_run_here``: the steps after the checkpoint it resumed from."""
    ref, got = (json.loads((d / "report_rank0.json").read_text()) for d in (reference, out))
    assert got["global_step"] == ref["global_step"] == 4
    assert got["steps_run_here"] == steps_run_here, "the run did not resume from the expected checkpoint"
    assert got["scheduler"] == ref["scheduler"] and got["optimizer_steps"] == ref["optimizer_steps"] == [4.0]
    ref_log, got_log = logged(reference), logged(out)
    assert [h["step"] for h in got_log] == [1, 2, 3, 4]  # those before the checkpoint come from its trainer state
    assert [h["learning_rate"] for h in got_log] == [h["learning_rate"] for h in ref_log]
    diffs = {"loss": max(abs(a["loss"] - b["loss"]) for a, b in zip(ref_log, got_log)),
             "grad_norm": max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(ref_log, got_log)),
             "weights": max_diff(*(load_file(d / "trained.safetensors") for d in (reference, out)))}
    for rank in (0, 1):
        diffs[f"adam_rank{rank}"] = max_diff(*(load_file(d / f"optimizer_rank{rank}.safetensors")
                                              for d in (reference, out)))
    print(f"\n{case}: max abs diff resumed vs uninterrupted: {diffs}")
    assert all(d <= ATOL for d in diffs.values()), diffs


def assert_fault_cost_nothing(out: Path, reference: Path, fault: list[str]) -> None:
    """After the fault: checkpoint-2 is whole and byte-identical to the uninterrupted run's, and nothing later (or
    half-written) can be picked by resume."""
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
    assert not [p.name for p in out.iterdir() if p.name.startswith("checkpoint-") and p.name != "checkpoint-2"]
    report = audit(str(out / "checkpoint-2"), base=default_model_path())
    assert report.ok, report.format()
    weights = [n for n in digest(reference / "checkpoint-2") if n.endswith(".safetensors")]
    assert weights and all(digest(out / "checkpoint-2")[n] == digest(reference / "checkpoint-2")[n] for n in weights)
    if "--kill_during_save" in fault or "--fail_save" in fault:  # the fault really hit the save of checkpoint-4
        assert (out / f".checkpoint-4{PARTIAL_SUFFIX}").is_dir()


# LoRA: on trl 1.14 the same seed gives the same adapter init only through trl_ext.trainers.compat.seed_before_model
COMPAT = "sft-lora-every-rank-killed-mid-training"


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.compat) if c == COMPAT else c for c in CASES])
def test_resume_after_a_fault_equals_the_uninterrupted_run(tmp_path, zero3_run, case):
    trainer, args, fault = CASES[case]
    reference, _ = zero3_run(trainer, "--lora" in args)

    faulty = train(tmp_path, trainer, "run", *args, *fault)
    out = tmp_path / "run"
    assert not faulty.timed_out, f"the job hung after the fault:\n{faulty.output[-4000:]}"
    assert faulty.returncode != 0, "the fault did not stop the run"
    if "--fail_save" in fault:  # every rank says what failed and where, and nothing hung
        error = "No space left on device"
        assert faulty.output.count(f"[Errno 28] {error}") >= 2, faulty.output[-6000:]
    if "--kill_rank" in fault:  # the survivor was stopped, and the launcher names the rank that died
        assert "Signal 9 (SIGKILL)" in faulty.output and "rank      : 1" in faulty.output, faulty.output[-6000:]
    assert_fault_cost_nothing(out, reference, fault)
    before = digest(out / "checkpoint-2")

    resumed = train(tmp_path, trainer, "run", *args, "--resume")
    assert resumed.returncode == 0, resumed.output[-6000:]
    assert digest(out / "checkpoint-2") == before, "resuming changed the checkpoint it resumed from"
    assert not list(out.glob(".*")), "a staging directory from the interrupted save was left behind"

    assert_resumed_equals_uninterrupted(reference, out, case, steps_run_here=2)
    for name in ("checkpoint-4",):  # the final checkpoint the resumed run wrote loads and passes the audit
        report = audit(str(out / name), base=default_model_path())
        assert report.ok, report.format()


def test_permission_denied_during_save_fails_cleanly_and_the_run_resumes(tmp_path, monkeypatch, tiny_model_path):
    """One process (cheap): the writer gets EACCES on checkpoint-2. The run stops with the cause and the fix, keeps
    checkpoint-1 byte for byte, leaves nothing resume could pick, and resumes once the directory is writable."""
    import errno

    from datasets import Dataset
    from peft import LoraConfig

    import trl_ext
    from trl_ext.errors import CheckpointError
    from trl_ext.files import shards

    append = shards.ShardStreamWriter.append

    def denied(self, piece):
        if "checkpoint-2" in str(self.directory):
            raise PermissionError(errno.EACCES, "Permission denied", str(self.directory))
        append(self, piece)

    rows = [{"messages": [{"role": "user", "content": f"{i}+1?"}, {"role": "assistant", "content": f"{i + 1}"}]}
            for i in range(8)]

    def trainer():
        args = trl_ext.SFTConfig(output_dir=str(tmp_path / "run"), max_steps=3, save_steps=1, seed=0,
                                 per_device_train_batch_size=2, report_to="none")
        return trl_ext.SFTTrainer(model=tiny_model_path, args=args, train_dataset=Dataset.from_list(rows),
                                  peft_config=LoraConfig(r=4, target_modules=["q_proj"]))

    monkeypatch.setattr(shards.ShardStreamWriter, "append", denied)
    with pytest.raises(CheckpointError, match=r"\[Errno 13\] Permission denied.*earlier saves are intact; free disk"):
        trainer().train()
    out = tmp_path / "run"
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-1") and not (out / "checkpoint-2").exists()
    assert audit(str(out / "checkpoint-1")).ok
    kept = digest(out / "checkpoint-1")

    monkeypatch.setattr(shards.ShardStreamWriter, "append", append)
    resumed = trainer()
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3 and digest(out / "checkpoint-1") == kept
    assert audit(str(out / "checkpoint-3")).ok and not list(out.glob(".*"))
