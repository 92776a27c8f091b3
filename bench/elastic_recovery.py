"""Recovery time under elastic torchrun: from a machine's death to the first training step after the run resumes by
itself, in parts, beside Slurm's requeue (bench/slurm_recovery.py).

    python bench/elastic_recovery.py [--last-call 2] [--processes 2]

Two machines simulated on this one (tests/machines.py), each ``torchrun --nnodes 1:2 --nproc-per-node 2
--max-restarts 3 --rdzv-backend c10d --rdzv-id ...`` running the DPO recipe (ZeRO-3, the embedded tiny model), as the
Slurm benchmark runs it. Once checkpoint-20 is committed, the second machine dies (its agent and ranks, SIGKILL); the
first machine's agent restarts its ranks alone, and they resume from checkpoint-20 with the same global batch. The
parts:

- failure detection: the kill -> the surviving machine's agent reports its ranks failed (their collectives broke);
- rendezvous: -> the restarted ranks' Python up (torchrun's new round: it waits ``last_call_timeout`` for more
  machines once it has the minimum, 30 s by default; ``--rdzv-conf last_call_timeout=N`` sets it);
- imports: -> the trainer being built;
- model load: the trainer built;
- checkpoint load: ``train()`` -> the checkpoint loaded (DeepSpeed's universal checkpoint for the other number of
  processes) -> the first step done.

The anchor is the first run's own start (Python up -> its first training step), measured in the same run. Times are
wall clock on this machine: run it on an idle machine.
"""

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _timing import first_events  # noqa: E402 - bench/, beside this file

from tests.machines import ELASTIC_ENV, TORCHRUN, Machine, wait_for_path, wait_for_port  # noqa: E402

DPO = ["bench/_recovery_worker.py", "--config", "accelerate_configs/zero3.yaml", "--config", "recipes/configs/dpo.yaml",
       "--max_steps", "60", "--save_steps", "20", "--save_strategy", "steps", "--eval_strategy", "no",
       "--per_device_train_batch_size", "2", "--report_to", "none"]



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--last-call", type=int, default=2, help="torchrun's last_call_timeout, s (its default: 30)")

    parser.add_argument("--processes", type=int, default=2, help="processes per machine")
    args = parser.parse_args()
    from trl_ext.launching.launch import free_port

    work = Path(tempfile.mkdtemp(prefix="trl-ext-elastic-"))
    out, port = work / "dpo", free_port()
    cmd = [*TORCHRUN, "--nnodes", "1:2", "--nproc-per-node", str(args.processes), "--max-restarts", "3",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench-elastic",
           "--rdzv-conf", f"last_call_timeout={args.last_call}", *DPO, "--output_dir", str(out)]
    env = {**ELASTIC_ENV, "TRL_EXT_BENCH_RECIPE": "recipes/dpo.py", "TRL_EXT_BENCH_STEP_SECONDS": "0.5"}
    first = Machine("first", cmd, env, work / "first.log")
    wait_for_port(port, 300, first)  # the first machine hosts the rendezvous; the second is the one that dies
    second = Machine("second", cmd, env, work / "second.log")
    wait_for_path(out / "checkpoint-20", 900, [first, second])
    killed = second.die()
    noticed = first.when(r"failed \(exitcode", 300, after=killed)
    code = first.wait(900)
    events = first_events(first.output)
    if code != 0 or ("first_step", 1) not in events:
        raise SystemExit(f"the run did not resume and complete (exit {code}):\n{first.output[-6000:]}")
    first_start = events[("first_step", 0)] - events[("start", 0)]
    parts = [
        ("failure detection: the kill -> the agent reports its ranks failed", noticed - killed),
        (f"rendezvous: -> the restarted ranks' Python up (last_call_timeout {args.last_call:g} s)",
         events[("start", 1)] - noticed),
        ("imports: -> the trainer being built", events[("trainer", 1)] - events[("start", 1)]),
        ("model load: the trainer built", events[("trainer_built", 1)] - events[("trainer", 1)]),
        ("checkpoint load: train() -> checkpoint loaded", events[("resumed", 1)] - events[("train", 1)]),
        ("  then -> the first step done", events[("first_step", 1)] - events[("resumed", 1)]),
    ]
    total = events[("first_step", 1)] - killed
    print(f"elastic torchrun, 2 machines x {args.processes} processes -> 1 machine; work directory {work}")
    for name, seconds in parts:
        print(f"  {name:<85} {seconds:7.1f} s")
    print(f"  {'between the parts (trainer built -> train())':<85} "
          f"{events[('train', 1)] - events[('trainer_built', 1)]:7.1f} s")
    resumed_start = events[("first_step", 1)] - events[("start", 1)]
    print(f"from the kill to the first step after the resume: {total:.1f} s; the resumed run's start (Python up -> "
          f"first step) {resumed_start:.1f} s = {resumed_start / first_start:.2f}x the first run's "
          f"({first_start:.1f} s)")


if __name__ == "__main__":
    main()
