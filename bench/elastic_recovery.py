"""Recovery time under elastic torchrun: from a machine's death to the first training step after the run resumes by
itself, in parts, beside Slurm's requeue (bench/slurm_recovery.py).

    python bench/elastic_recovery.py [--last-call 2] [--keep-alive 5] [--processes 2] [--memory] [--pods]

Two machines simulated on this one (tests/machines.py), each ``torchrun --nnodes 1:2 --nproc-per-node 2
--max-restarts 3 --rdzv-backend c10d --rdzv-id ...`` running the DPO recipe (ZeRO-3, the embedded tiny model), as the
Slurm benchmark runs it. Once checkpoint-20 is committed, the second machine dies (its agent and ranks, SIGKILL); the
first machine's agent restarts its ranks alone, and they resume from checkpoint-20 with the same global batch. The
parts:

- failure detection: the kill -> the surviving machine's agent reports its ranks failed (their collectives broke);
- rendezvous: -> the restarted ranks' Python up (torchrun's new round: it waits ``last_call_timeout`` for more
  machines once it has the minimum, 30 s by default; and until the dead machine's heartbeats have expired,
  ``keep_alive_interval`` x ``keep_alive_max_attempt``, 5 s x 3 by default; ``--rdzv-conf`` sets them);
- imports: -> the trainer being built;
- model load: the trainer built;
- checkpoint load: ``train()`` -> the checkpoint loaded (DeepSpeed's universal checkpoint for the other number of
  processes) -> the first step done.

With ``--pods``, the machines are pods whose command is the recipe, with a PyTorchJob's elastic variables
(``PET_NNODES=1:2``, ``PET_RDZV_ENDPOINT``) and nothing else: trl_ext starts torchrun with its own rendezvous settings
(``launching.elastic``; ``--last-call`` and ``--keep-alive`` are not used). Its agents' log is kept at ERROR (trl_ext
keeps it at CRITICAL), where they report their ranks failed.

With ``--memory``, two runs: the same with memory checkpoints every 2 steps (each machine its own
``TRL_EXT_MEMORY_DIR``), the second machine killed once memory checkpoint-26 is replicated, the first resuming from
its memory; then the disk-only run, killed as long after its checkpoint-20. Each says the steps it lost.

The anchor is the first run's own start (Python up -> its first training step), measured in the same run. Times are
wall clock on this machine: run it on an idle machine.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _timing import first_events, resumed_parts, steps_at_the_kill  # noqa: E402 - bench/, beside this file

from tests.machines import ELASTIC_ENV, TORCHRUN, Machine, wait_for_path, wait_for_port  # noqa: E402

DPO = ["bench/_recovery_worker.py", "--config", "accelerate_configs/zero3.yaml", "--config", "recipes/configs/dpo.yaml",
       "--max_steps", "60", "--save_steps", "20", "--save_strategy", "steps", "--eval_strategy", "no",
       "--per_device_train_batch_size", "2", "--report_to", "none"]
DISK_STEP, MEMORY_STEP, MEMORY_EVERY = 20, 26, 2



def _run(label: str, work: Path, args, memory: bool, kill_after: float | None) -> dict:
    from trl_ext.launching import elastic
    from trl_ext.launching.launch import free_port

    out, port = work / label, free_port()
    recipe = [*DPO, "--output_dir", str(out), *(["--memory_checkpoint_steps", str(MEMORY_EVERY)] if memory else [])]
    if args.pods:  # trl_ext's settings, as its node launcher passes them
        conf = ",".join(f"{key}={value}" for key, value in elastic.RENDEZVOUS.items())
        cmd = [sys.executable, *recipe]
    else:
        conf = f"last_call_timeout={args.last_call},keep_alive_interval={args.keep_alive}"
        cmd = [*TORCHRUN, "--nnodes", "1:2", "--nproc-per-node", str(args.processes), "--max-restarts", "3",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench-elastic-{label}",
               "--rdzv-conf", conf, *recipe]
    machines = []
    for rank in (0, 1):
        started = ({"PET_NNODES": "1:2", "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}", "PET_RDZV_ID": f"bench-{label}",
                    "PET_NPROC_PER_NODE": str(args.processes), "HOSTNAME": f"bench-worker-{rank}", "LOGLEVEL": "ERROR"}
                   if args.pods else ELASTIC_ENV)
        env = {**started, "TRL_EXT_BENCH_RECIPE": "recipes/dpo.py", "TRL_EXT_BENCH_STEP_SECONDS": "0.5",
               "TRL_EXT_MEMORY_DIR": str(work / f"{label}-shm-{rank}")}
        machines.append(Machine(f"{label}-{rank}", cmd, env, work / f"{label}-{rank}.log"))
        if rank == 0:
            wait_for_port(port, 300, machines[0])  # the first machine hosts the rendezvous; the second dies
    first, second = machines
    committed = out / f"checkpoint-{DISK_STEP}"
    if memory:
        deadline = time.monotonic() + 900  # replicated: both machines wrote its manifest
        while not all(any((work / f"{label}-shm-{r}").glob(f"*/.checkpoint-{MEMORY_STEP}.manifest.json"))
                      for r in (0, 1)):
            if time.monotonic() > deadline or first.proc.poll() is not None:
                raise SystemExit(f"{label}: memory checkpoint-{MEMORY_STEP} never replicated:\n{first.output[-4000:]}")
            time.sleep(0.01)
    else:
        wait_for_path(committed, 900, machines)
        time.sleep(kill_after or 0.0)
    killed = second.die()
    noticed = first.when(r"failed \(exitcode", 300, after=killed)
    code = first.wait(900)
    events = first_events(first.output)
    if code != 0 or ("first_step", 1) not in events:
        raise SystemExit(f"{label}: the run did not resume and complete (exit {code}):\n{first.output[-6000:]}")
    last_step, resumed_step = steps_at_the_kill(first.output, killed)
    return {
        "parts": [
            ("failure detection: the kill -> the agent reports its ranks failed", noticed - killed),
            (f"rendezvous: -> the restarted ranks' Python up ({conf})", events[("start", 1)] - noticed),
            *resumed_parts(events),
        ],
        "total": events[("first_step", 1)] - killed,
        "first_start": events[("first_step", 0)] - events[("start", 0)],
        "resumed_start": events[("first_step", 1)] - events[("start", 1)],
        "last_step": last_step, "resumed_step": resumed_step,
        "since_disk": killed - committed.stat().st_mtime if committed.exists() else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--last-call", type=int, default=2, help="torchrun's last_call_timeout, s (its default: 30)")
    parser.add_argument("--keep-alive", type=int, default=5, help="torchrun's keep_alive_interval, s (its default: 5)")
    parser.add_argument("--processes", type=int, default=2, help="processes per machine")
    parser.add_argument("--memory", action="store_true", help="a run with memory checkpoints, then the disk-only one")
    parser.add_argument("--pods", action="store_true", help="pods whose command is the recipe: trl_ext's settings")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trl-ext-elastic-"))
    runs = {}
    if args.memory:
        runs["memory"] = _run("memory", work, args, True, None)
    runs["disk"] = _run("disk", work, args, False, runs["memory"]["since_disk"] if args.memory else 0.0)
    started = "pods with the recipe as their command" if args.pods else "torchrun commands"
    print(f"elastic torchrun ({started}), 2 machines x {args.processes} processes -> 1 machine; work directory {work}")
    for label, run in runs.items():
        print(f"{label}: killed after step {run['last_step']}, resumed from step {run['resumed_step']} "
              f"({run['last_step'] - run['resumed_step']} step(s) lost)")
        for name, seconds in run["parts"]:
            print(f"  {name:<85} {seconds:7.1f} s")
        print(f"  from the kill to the first step after the resume: {run['total']:.1f} s; the resumed run's start "
              f"(Python up -> first step) {run['resumed_start']:.1f} s = "
              f"{run['resumed_start'] / run['first_start']:.2f}x the first run's ({run['first_start']:.1f} s)")
    if args.memory:
        print(f"recovery, memory over disk: {runs['memory']['total'] / runs['disk']['total']:.2f}x")


if __name__ == "__main__":
    main()
