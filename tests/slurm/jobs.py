"""What the recipe tests under Slurm share: the DPO job they all run (ZeRO-3, the same seed and global batch, so one
uninterrupted 2-node run is the reference of all of them), submitting it through ``recipes/slurm.sbatch``, running it
through ``slowed.py``, waiting for what a test needs, and comparing saved models."""

import re
import time
from pathlib import Path

import torch

from tests.harness import REPO
from tests.slurm.cluster import TERMINAL_STATES
from trl_ext.files.audit import audit

SBATCH = REPO / "recipes" / "slurm.sbatch"
STEPS, SAVE_STEPS = 60, 20
DPO = ["recipes/dpo.py", "--config", "accelerate_configs/zero3.yaml", "--config", "recipes/configs/dpo.yaml",
       "--num_processes", "2", "--max_steps", str(STEPS), "--save_steps", str(SAVE_STEPS), "--save_strategy", "steps",
       "--eval_strategy", "no", "--per_device_train_batch_size", "4", "--report_to", "none"]
# The node-range job: two processes per node (no --num_processes), four on two nodes, 16 rows a step; two on one
# node, accumulating two batches (the same 16 rows in the same batches of 4), as this uninterrupted reference does.
# 24 steps (checkpoints 20 and 24) at a tenth of the recipe's learning rate: at 3e-3 this tiny model's training is
# chaotic, and the last bits that differ between four processes and two (the order of the sums) grow to whole logits.
RANGED_STEPS = 24
RANGED = [arg for arg in DPO if arg not in ("--num_processes", "2")] + ["--max_steps", str(RANGED_STEPS),
                                                                       "--learning_rate", "3e-4"]
RANGED_REFERENCE = [*DPO, "--gradient_accumulation_steps", "2", "--max_steps", str(RANGED_STEPS),
                    "--learning_rate", "3e-4"]
SFT_FSDP2 = ["recipes/sft.py", "--config", "accelerate_configs/fsdp2.yaml", "--config", "recipes/configs/sft.yaml",
             "--num_processes", "2", "--max_steps", "20", "--eval_strategy", "no", "--report_to", "none"]
PROBE = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]])
ATOL = 1e-5  # the same run on the same number of processes
TRAJECTORY_SHARE = 0.01  # another number of processes: the end within 1% of the way training moved the model


def submit(cluster, out: Path, args: list[str], nodes: int | str = 2, sbatch: list[str] = (), env: dict | None = None):
    """``sbatch -N<nodes> [sbatch] recipes/slurm.sbatch <args> --output_dir <out>``, from the repository, with ``env``
    added to the job's environment; the job's log is ``<out>.log``."""
    return cluster.sbatch([f"-N{nodes}", f"--output={out}.log", *sbatch], SBATCH, cwd=REPO,
                          script_args=[*args, "--output_dir", str(out)], env=env)


def slowed(args: list[str], runs: str = "0", **options) -> tuple[list[str], dict]:
    """``args`` run through tests/slurm/slowed.py, and the environment that says what it does in ``runs``.

    Args:
        args: the recipe and its options.
        runs: the runs (restart counts, comma-separated) the options apply to.
        **options: ``step_seconds``, ``slow_checkpoint``, ``hold`` (what to hold, comma-separated) with ``hold_dir``,
            ``raise_at_step``; ``memory_dir`` (with ``{node}``: each node's memory tier, in every run).
    """
    env = {"TRL_EXT_TEST_RECIPE": args[0], "TRL_EXT_TEST_RUNS": runs}
    names = {"step_seconds": "TRL_EXT_TEST_STEP_SECONDS", "slow_checkpoint": "TRL_EXT_TEST_SLOW_CHECKPOINT",
             "hold": "TRL_EXT_TEST_HOLD", "hold_dir": "TRL_EXT_TEST_HOLD_DIR",
             "raise_at_step": "TRL_EXT_TEST_RAISE_AT_STEP", "memory_dir": "TRL_EXT_TEST_MEMORY_DIR"}
    env.update({names[key]: str(value) for key, value in options.items()})
    return ["tests/slurm/slowed.py", *args[1:]], env


def log_of(out: Path) -> str:
    return Path(f"{out}.log").read_text(errors="replace")


def finished(cluster, job: str, out: Path, timeout: float = 400, min_restarts: int = 0) -> str:
    """Waits for the job to complete (``timeout``: seconds out of the queue with its log unchanged, a hang's bound),
    checks that it saved and verified its model, and returns its log."""
    info = cluster.wait_state(job, "COMPLETED", timeout=timeout, min_restarts=min_restarts, count_pending=False,
                              output=Path(f"{out}.log"))
    log = log_of(out)
    assert info["ExitCode"] == "0:0", log[-4000:]
    assert "saved and verified" in log, log[-4000:]
    return log


def outputs(directory: Path) -> torch.Tensor:
    """The saved model's logits on a fixed probe, loaded with plain transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def assert_same_model(got: Path, want: Path, atol: float = ATOL) -> None:
    report = audit(str(got))
    assert report.ok, report.format()
    diff = (outputs(got) - outputs(want)).abs().max().item()
    assert diff <= atol, f"{got} differs from {want} by {diff}"


def assert_on_trajectory(got: Path, want: Path, start: str) -> float:
    """``got`` ended where ``want`` (the uninterrupted run) ended, within ``TRAJECTORY_SHARE`` of how far training
    moved the model from ``start`` (the base model): a scale-free tolerance for runs whose sums differ in order.
    Returns the share measured."""
    report = audit(str(got))
    assert report.ok, report.format()
    moved = (outputs(want) - outputs(start)).abs().max().item()
    share = (outputs(got) - outputs(want)).abs().max().item() / moved
    assert share <= TRAJECTORY_SHARE, f"{got} ends {share:.2%} of training's way from {want}"
    return share


def wait_for(predicate, timeout: float, what: str, cluster=None, job: str | None = None) -> None:
    """Waits until ``predicate()`` holds.

    Args:
        predicate: What to wait for.
        timeout: Seconds before AssertionError; with a job (`SlurmCluster.wait_until`), only those it spends out of
            the queue count (how long it queues depends on the jobs before it, not on it), and the wait fails at once,
            with a SlurmError, if the job ends first.
        what: What is waited for, for the message.
        cluster: The cluster running ``job``.
        job: The job whose work ``predicate`` waits for.
    """
    if job is not None:
        cluster.wait_until(job, lambda info: predicate(), lambda info: info.get("JobState") in TERMINAL_STATES,
                           timeout, what, count_pending=False, poll=0.5)
        return
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.2)


def wait_for_line(out: Path, text: str, timeout: float = 300, after: int = 0, cluster=None,
                  job: str | None = None) -> int:
    """Waits until the job's log holds ``text`` past character ``after``; returns where it ends. ``timeout``,
    ``cluster`` and ``job``: as for `wait_for`."""
    found = []

    def seen() -> bool:
        at = log_of(out).find(text, after) if Path(f"{out}.log").exists() else -1
        found[:] = [at + len(text)] if at >= 0 else []
        return bool(found)

    wait_for(seen, timeout, f"{text!r} in {out}.log", cluster, job)
    return found[0]


def release(hold_dir: Path, what: str) -> None:
    """Lets a run held at ``what`` (slowed.py) go on."""
    (hold_dir / f"release-{what}").touch()


def quiet(log: str) -> None:
    """A planned stop prints no traceback (torchrun's ChildFailedError included)."""
    assert "Traceback" not in log and "ChildFailedError" not in log, log[-6000:]


def node_lines(log: str) -> list[str]:
    """The nodes' launchers' lines (``[trl_ext] Slurm job N, node K (nX): ...``; a progress bar may precede one)."""
    return re.findall(r"\[trl_ext\] Slurm job \d+, node \d+ \(n\d\): [^\r\n]*", log)
