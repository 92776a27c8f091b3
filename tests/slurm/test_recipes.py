"""Recipes under a real Slurm (two slurmd nodes on this host) through ``sbatch recipes/slurm.sbatch``: a 2-node run
saves what the same run on one node saves, and a run stopped by ``scontrol requeue``, by the time-limit warning
(``--signal`` before ``--time``) or by a requeue that lands while a checkpoint is written, is requeued, resumes from
its newest committed checkpoint by itself and ends with the uninterrupted run's model.

Every DPO run is the same job (ZeRO-3, 2 processes in all, the same seed and global batch), so one uninterrupted
2-node run is the reference of all of them; the FSDP2 case trains SFT.
"""

import time
from pathlib import Path

import pytest
import torch

from tests.harness import REPO
from trl_ext.files.audit import audit

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

SBATCH = REPO / "recipes" / "slurm.sbatch"
STEPS, SAVE_STEPS = 60, 20
DPO = ["recipes/dpo.py", "--config", "accelerate_configs/zero3.yaml", "--config", "recipes/configs/dpo.yaml",
       "--num_processes", "2", "--max_steps", str(STEPS), "--save_steps", str(SAVE_STEPS), "--save_strategy", "steps",
       "--eval_strategy", "no", "--per_device_train_batch_size", "4", "--report_to", "none"]
SFT_FSDP2 = ["recipes/sft.py", "--config", "accelerate_configs/fsdp2.yaml", "--config", "recipes/configs/sft.yaml",
             "--num_processes", "2", "--max_steps", "20", "--eval_strategy", "no", "--report_to", "none"]
PROBE = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]])
ATOL = 1e-5


def submit(cluster, out: Path, args: list[str], nodes: int = 2, sbatch: list[str] = (), env: dict | None = None):
    """``sbatch -N<nodes> [sbatch] recipes/slurm.sbatch <args> --output_dir <out>``, from the repository, with ``env``
    added to the job's environment."""
    return cluster.sbatch([f"-N{nodes}", f"--output={out}.log", *sbatch], SBATCH, cwd=REPO,
                          script_args=[*args, "--output_dir", str(out)], env=env)


def slowed(args: list[str], step_seconds: float | None = None, checkpoint: int | None = None):
    """``args`` run through tests/slurm/slowed.py, and the environment that says what it slows in the first run."""
    env = {"TRL_EXT_TEST_RECIPE": args[0]}
    if step_seconds is not None:
        env["TRL_EXT_TEST_STEP_SECONDS"] = str(step_seconds)
    if checkpoint is not None:
        env["TRL_EXT_TEST_SLOW_CHECKPOINT"] = str(checkpoint)
    return ["tests/slurm/slowed.py", *args[1:]], env


def finished(cluster, job: str, out: Path, timeout: float = 400, min_restarts: int = 0) -> str:
    info = cluster.wait_state(job, "COMPLETED", timeout=timeout, min_restarts=min_restarts)
    log = Path(f"{out}.log").read_text(errors="replace")
    assert info["ExitCode"] == "0:0", log[-4000:]
    assert "saved and verified" in log, log[-4000:]
    return log


def outputs(directory: Path) -> torch.Tensor:
    """The saved model's logits on a fixed probe, loaded with plain transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def assert_same_model(got: Path, want: Path) -> None:
    report = audit(str(got))
    assert report.ok, report.format()
    diff = (outputs(got) - outputs(want)).abs().max().item()
    assert diff <= ATOL, f"{got} differs from {want} by {diff}"


def wait_for(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory):
    """The uninterrupted 2-node DPO run (every other DPO run must end with its model)."""
    out = tmp_path_factory.mktemp("slurm") / "reference"
    job = submit(slurm_cluster, out, DPO)
    log = finished(slurm_cluster, job, out)
    return out, log


def test_two_nodes_train_what_one_node_trains(slurm_cluster, reference, tmp_path):
    out, log = reference
    assert "2 machine(s), this one number 0, 2 processes, rendezvous 127.0.0.1:" in log, log[-4000:]
    assert "replace the accelerate config's machines" in log
    one = tmp_path / "one-node"
    finished(slurm_cluster, submit(slurm_cluster, one, DPO, nodes=1), one)
    assert_same_model(out, one)


def test_a_requeued_job_resumes_from_its_checkpoint_by_itself(slurm_cluster, reference, tmp_path):
    out = tmp_path / "requeued"
    args, env = slowed(DPO, step_seconds=0.25)  # its first run is still training when it is requeued
    job = submit(slurm_cluster, out, args, env=env)
    wait_for(lambda: (out / f"checkpoint-{SAVE_STEPS}").is_dir(), 300, f"checkpoint-{SAVE_STEPS}")
    slurm_cluster.requeue(job)
    slurm_cluster.start_now(job)
    log = finished(slurm_cluster, job, out, min_restarts=1)
    assert "SIGTERM received: saved" in log, log[-6000:]  # the ranks' stop, with the checkpoint it saved
    assert f"Slurm job {job}, restart 1: resuming from {out}/checkpoint-" in log, log[-6000:]
    assert_same_model(out, reference[0])


def test_the_time_limit_warning_saves_requeues_and_resumes(slurm_cluster, reference, tmp_path):
    """``--time=2 --signal=B:USR1@115``: Slurm's warning comes at its first check, about 30 s in, while the first run
    trains (its steps are slowed so that it still does then; if the warning comes before training starts, it acts as
    soon as training has): the ranks save and stop, the script requeues the job. The requeued run is given time to
    finish."""
    out = tmp_path / "time-limit"
    args, env = slowed(DPO, step_seconds=0.75)
    job = submit(slurm_cluster, out, args, sbatch=["--time=2", "--signal=B:USR1@115"], env=env)
    slurm_cluster.wait_state(job, {"PENDING", "RUNNING"}, timeout=300, min_restarts=1)
    slurm_cluster.run(["scontrol", "update", f"JobId={job}", "TimeLimit=15"])
    slurm_cluster.start_now(job)
    log = finished(slurm_cluster, job, out, min_restarts=1)
    assert "SIGUSR1 received: saved" in log and "stopped on the time-limit warning" in log, log[-6000:]
    assert f"Slurm job {job}, restart 1: resuming from {out}/checkpoint-" in log, log[-6000:]
    assert_same_model(out, reference[0])


def test_a_requeue_while_a_checkpoint_is_written_resumes_the_previous_one(slurm_cluster, reference, tmp_path):
    """checkpoint-40's writer stalls (first run only) and the requeue comes while it is being written: SIGTERM, then
    SIGKILL after KillWait. The requeued run resumes from checkpoint-20, the newest committed one."""
    out = tmp_path / "mid-save"
    slow = 2 * SAVE_STEPS
    args, env = slowed(DPO, checkpoint=slow)
    job = submit(slurm_cluster, out, args, env=env)
    wait_for(lambda: (out / f".checkpoint-{slow}.trl_ext-partial").is_dir(), 300, f"checkpoint-{slow}'s save")
    time.sleep(2)  # well inside its writer's stall
    slurm_cluster.requeue(job)
    slurm_cluster.start_now(job, timeout=120)
    log = finished(slurm_cluster, job, out, min_restarts=1)
    assert f"Slurm job {job}, restart 1: resuming from {out}/checkpoint-{SAVE_STEPS}\n" in log, log[-6000:]
    assert not list(out.glob(".*partial")), "the interrupted save's staging directory was left behind"
    assert_same_model(out, reference[0])


def test_an_fsdp2_recipe_on_two_nodes_trains_what_one_node_trains(slurm_cluster, tmp_path):
    two, one = tmp_path / "fsdp2-two", tmp_path / "fsdp2-one"
    finished(slurm_cluster, submit(slurm_cluster, two, SFT_FSDP2), two)
    finished(slurm_cluster, submit(slurm_cluster, one, SFT_FSDP2, nodes=1), one)
    assert_same_model(two, one)
