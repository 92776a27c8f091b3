"""Recovery time under Slurm: from a node's death to the first training step after the job resumes, in parts.

    python bench/slurm_recovery.py [--slurmd-timeout 20] [--cred-expire 5]

On a private 2-node Slurm cluster on this host (tests/slurm/cluster.py; needs Slurm installed, as .ci/slurm.sh does),
the DPO recipe (ZeRO-3, the embedded tiny model) runs with ``sbatch -N 1-2``, two processes per node. Once its
checkpoint-20 is committed, node n2 is killed as a power loss would (slurmd, slurmstepd and every task, SIGKILL); the
job is requeued and runs again on n1 alone, resuming with the same global batch. The parts:

- failure detection: the kill -> the surviving ranks report the lost peer (ours: gloo's broken connection), and
  -> the job requeued (Slurm's: srun waits for the dead node until SlurmdTimeout marks it DOWN);
- requeue wait: requeued -> running again (Slurm's: cred_expire and the scheduler);
- launch and imports: running -> the first rank's Python up (the script, srun, the node launcher, the recipe's checks
  and its re-launch) -> the trainer being built (imports of TRL and transformers);
- model load: the trainer built (the policy and reference models);
- checkpoint load: ``train()`` -> the checkpoint loaded (choosing it, DeepSpeed's universal checkpoint for the other
  number of processes, the engine built and loaded) -> the first training step done.

The anchor is the first run's own start (running -> its first training step), measured in the same job: the
resumed run's start is printed as a ratio of it. Times are wall clock on this machine: run it on an idle machine.
"""

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _timing import first_events  # noqa: E402 - bench/, beside this file

from tests.slurm.cluster import SlurmCluster  # noqa: E402

DPO = ["recipes/dpo.py", "--config", "accelerate_configs/zero3.yaml", "--config", "recipes/configs/dpo.yaml",
       "--max_steps", "60", "--save_steps", "20", "--save_strategy", "steps", "--eval_strategy", "no",
       "--per_device_train_batch_size", "2", "--report_to", "none"]



def _when_in_log(log_path: Path, text: str, timeout: float) -> float:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if log_path.exists() and text in log_path.read_text(errors="replace"):
            return time.time()
        time.sleep(0.05)
    raise TimeoutError(f"{text!r} not in {log_path} after {timeout} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slurmd-timeout", type=int, default=20, help="SlurmdTimeout (Slurm's default: 300)")
    parser.add_argument("--cred-expire", type=int, default=5, help="cred_expire (Slurm's default: 120)")
    args = parser.parse_args()
    import os
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="trl-ext-recovery-"))
    out = work / "dpo"
    with SlurmCluster(cpus_per_node=4, kill_wait=10, slurmd_timeout=args.slurmd_timeout,
                      cred_expire=args.cred_expire) as cluster:
        cluster.env["TORCH_EXTENSIONS_DIR"] = os.path.join(sys.prefix, "torch_extensions")
        env = {"TRL_EXT_BENCH_RECIPE": "recipes/dpo.py", "TRL_EXT_BENCH_STEP_SECONDS": "0.5"}
        job = cluster.sbatch(["-N1-2", f"--output={out}.log"], REPO / "recipes" / "slurm.sbatch", cwd=REPO,
                             script_args=["bench/_recovery_worker.py", *DPO[1:], "--output_dir", str(out)], env=env)
        first_running = _running_since(cluster, job, 0)
        while not (out / "checkpoint-20").is_dir():
            time.sleep(0.05)
        killed = time.time()
        cluster.kill_node("n2")
        noticed = _when_in_log(Path(f"{out}.log"), "lost a peer or its node", 300)
        requeued = _state_since(cluster, job, "PENDING", 1)
        running = _running_since(cluster, job, 1)
        info = cluster.wait_state(job, "COMPLETED", timeout=900, min_restarts=1)
        log = Path(f"{out}.log").read_text(errors="replace")
    events = first_events(log)
    first_start = events[("first_step", 0)] - first_running
    parts = [
        ("failure detection: the ranks report the lost peer (ours)", noticed - killed),
        ("failure detection: Slurm marks the node DOWN and requeues (SlurmdTimeout)", requeued - noticed),
        ("requeue wait: pending -> running (cred_expire, scheduler)", running - requeued),
        ("launch: running -> the ranks' Python up (script, srun, launcher, checks, re-launch)",
         events[("start", 1)] - running),
        ("imports: -> the trainer being built", events[("trainer", 1)] - events[("start", 1)]),
        ("model load: the trainer built", events[("trainer_built", 1)] - events[("trainer", 1)]),
        ("checkpoint load: train() -> checkpoint loaded", events[("resumed", 1)] - events[("train", 1)]),
        ("  then -> the first step done", events[("first_step", 1)] - events[("resumed", 1)]),
    ]
    total = events[("first_step", 1)] - killed
    print(f"job {job}: nodes {info.get('NodeList')}, restarts {info.get('Restarts')}; SlurmdTimeout "
          f"{args.slurmd_timeout} s, cred_expire {args.cred_expire} s")
    for name, seconds in parts:
        print(f"  {name:<85} {seconds:7.1f} s")
    print(f"  {'between the parts (trainer built -> train())':<85} "
          f"{events[('train', 1)] - events[('trainer_built', 1)]:7.1f} s")
    resumed_start = events[("first_step", 1)] - running
    print(f"from the kill to the first step after the resume: {total:.1f} s; the resumed run's start (running -> "
          f"first step) {resumed_start:.1f} s = {resumed_start / first_start:.2f}x the first run's "
          f"({first_start:.1f} s)")


def _state_since(cluster, job: str, state: str, restarts: int) -> float:
    cluster.wait_state(job, {state, "RUNNING", "COMPLETED"}, timeout=900, min_restarts=restarts)
    return time.time()


def _running_since(cluster, job: str, restarts: int) -> float:
    cluster.wait_state(job, {"RUNNING", "COMPLETED"}, timeout=900, min_restarts=restarts)
    return time.time()


if __name__ == "__main__":
    main()
