"""The memory tier on one machine: what a memory checkpoint holds training, the steps a lost rank costs, and the time
from the kill to the first step after the resume, in parts, beside the same loss resumed from disk.

    python bench/memory_recovery.py [--processes 2] [--memory_steps 2] [--step_seconds 0.3]

The DPO recipe as users start it (``python recipes/dpo.py --config accelerate_configs/zero3.yaml``, the embedded tiny
model), with a disk checkpoint every 20 steps (in the foreground) and ``--memory_checkpoint_steps``. Two runs, one
after the other:

- memory: once memory checkpoint-26 is committed, rank 1 is SIGKILLed; the launch restarts its ranks, which resume
  from memory;
- disk: the same run with the memory tier off (``TRL_EXT_MEMORY_DIR`` where nothing can be written: said, and the
  launch restarts its ranks all the same); rank 1 is SIGKILLed as long after checkpoint-20 as in the first run, and
  the ranks resume from checkpoint-20 on disk.

Each prints the parts (the kill -> the launch's agent reports its ranks failed -> the restarted ranks' Python up ->
the trainer being built -> built -> ``train()`` -> the checkpoint loaded -> the first step done), the steps lost (the
last step done before the kill, less the step resumed), and, for the memory run, each memory checkpoint's
``memory_checkpoint/held_s`` against the foreground checkpoint-20's ``checkpoint/held_s``. Times are wall clock on
this machine: run it on an idle machine.
"""

import argparse
import ast
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _timing import first_events, resumed_parts, steps_at_the_kill  # noqa: E402 - bench/, beside this file

from tests.machines import Machine, rank_process  # noqa: E402

DISK_STEP, MEMORY_STEP = 20, 26



def _metrics(log: str, name: str) -> list[float]:
    """Every logged value of metric ``name`` (the console's dicts of logs)."""
    values = []
    for line in log.splitlines():
        start = line.find("{'")
        if start < 0 or name not in line:
            continue
        try:
            logs = ast.literal_eval(line[start:line.rindex("}") + 1])
        except (ValueError, SyntaxError):
            continue
        if name in logs:
            values.append(float(logs[name]))
    return values


def _run(label: str, work: Path, args, memory_dir: str, kill_after: float | None) -> dict:
    out = work / label
    cmd = [sys.executable, "bench/_recovery_worker.py", "--config", "accelerate_configs/zero3.yaml", "--config",
           "recipes/configs/dpo.yaml", "--output_dir", str(out), "--max_steps", "60", "--save_strategy", "steps",
           "--save_steps", str(DISK_STEP), "--memory_checkpoint_steps", str(args.memory_steps), "--eval_strategy",
           "no", "--eval_on_start", "false", "--per_device_train_batch_size", "2", "--logging_steps", "1",
           "--report_to", "none", "--num_processes", str(args.processes)]
    env = {"TRL_EXT_BENCH_RECIPE": "recipes/dpo.py", "TRL_EXT_BENCH_STEP_SECONDS": str(args.step_seconds),
           "TRL_EXT_MEMORY_DIR": memory_dir, "HF_HOME": str(work / "hf")}
    machine = Machine(label, cmd, env, work / f"{label}.log")
    committed = out / f"checkpoint-{DISK_STEP}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if kill_after is None and any(Path(memory_dir).glob(f"*/.checkpoint-{MEMORY_STEP}.manifest.json")):
            break
        if kill_after is not None and committed.is_dir():
            time.sleep(kill_after)
            break
        time.sleep(0.01)
    victim = rank_process(machine.proc.pid, 1)
    if victim is None:
        raise SystemExit(f"{label}: no rank 1 to kill:\n{machine.output[-4000:]}")
    victim.kill()
    killed = time.time()
    noticed = machine.when(r"failed \(exitcode", 300, after=killed)
    code = machine.wait(900)
    events = first_events(machine.output)
    if code != 0 or ("first_step", 1) not in events:
        raise SystemExit(f"{label}: the run did not resume and complete (exit {code}):\n{machine.output[-6000:]}")
    last_step, resumed_step = steps_at_the_kill(machine.output, killed)
    return {
        "parts": [
            ("the kill -> the launch reports its ranks failed", noticed - killed),
            ("-> the restarted ranks' Python up", events[("start", 1)] - noticed),
            *resumed_parts(events),
        ],
        "total": events[("first_step", 1)] - killed,
        "last_step": last_step, "resumed_step": resumed_step,
        "since_disk": killed - (committed.stat().st_mtime if committed.exists() else killed),
        "memory_held": _metrics(machine.output, "memory_checkpoint/held_s"),
        "disk_held": _metrics(machine.output, "checkpoint/held_s"),
        "output": machine.output,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--memory_steps", type=int, default=2, help="memory_checkpoint_steps")
    parser.add_argument("--step_seconds", type=float, default=0.3, help="each step of the first attempt lasts at "
                        "least this long (so that the kill lands while it trains)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trl-ext-memory-"))
    memory = _run("memory", work, args, str(work / "shm"), None)
    # the disk run is killed as long after its checkpoint-20 as the memory run was
    disk = _run("disk", work, args, "/proc/trl_ext-nowhere", max(memory["since_disk"], 0.0))
    print(f"one machine, {args.processes} processes, DPO recipe under ZeRO-3; memory checkpoint every "
          f"{args.memory_steps} steps, disk every {DISK_STEP}; work directory {work}")
    for label, run in (("memory", memory), ("disk", disk)):
        print(f"{label}: killed after step {run['last_step']}, resumed from step {run['resumed_step']} "
              f"({run['last_step'] - run['resumed_step']} step(s) lost)")
        for name, seconds in run["parts"]:
            print(f"  {name:<60} {seconds:7.2f} s")
        print(f"  {'from the kill to the first resumed step':<60} {run['total']:7.2f} s")
    print(f"recovery, memory over disk: {memory['total'] / disk['total']:.2f}x")
    held, foreground = memory["memory_held"], memory["disk_held"]
    if held and foreground:
        print(f"memory checkpoints held training: median {statistics.median(held) * 1000:.1f} ms (max "
              f"{max(held) * 1000:.1f} ms, {len(held)} checkpoints); the foreground checkpoint-{DISK_STEP}: "
              f"{foreground[0] * 1000:.1f} ms; ratio {statistics.median(held) / foreground[0]:.3f}x")


if __name__ == "__main__":
    main()
