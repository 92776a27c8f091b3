"""trl_ext's trainers vs TRL's on the same LoRA workload: steady-state step time, in one run.

    python bench/overhead.py [--repeats 3] [--steps 14]

SFT, Reward and DPO, LoRA (all-linear, r=8) on a random Llama (hidden 256, 4 layers, sequence 256, batch 4 per
rank), gradient checkpointing off, under one process and under 2-process ZeRO-3 on CPU
(`stage3_param_persistence_threshold: 0`). Runs alternate TRL / trl_ext; each run's step time is the median of its
steps after the first 4, and the table shows the median over repeats and the ratio trl_ext / TRL.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.harness import launch, write_accelerate_config

WORKER = Path(__file__).with_name("_overhead_worker.py")


def run(setup: str, config: Path, worker_args: list[str]) -> dict:
    if setup == "1 process":
        done = subprocess.run([sys.executable, str(WORKER), *worker_args], capture_output=True, text=True,
                              timeout=900, check=False)
        code, output = done.returncode, done.stdout + done.stderr
    else:
        result = launch(WORKER, worker_args, config, timeout=900)
        code, output = result.returncode, result.output
    lines = [line for line in output.splitlines() if line.startswith("BENCH ")]
    if code != 0 or not lines:
        sys.exit(f"run failed ({code}): {worker_args}\n{output[-3000:]}")
    return json.loads(lines[-1][6:])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--trainers", nargs="+", default=["sft", "reward", "dpo"])
    cli = parser.parse_args()

    config = write_accelerate_config(Path(tempfile.mkdtemp(prefix="bench-overhead-")), "zero3")
    rows = []
    for setup in ("1 process", "2-process ZeRO-3"):
        for trainer in cli.trainers:
            times = {"trl": [], "trl_ext": []}
            for _ in range(cli.repeats):
                for impl in times:
                    args = ["--impl", impl, "--trainer", trainer, "--steps", str(cli.steps)]
                    times[impl].append(run(setup, config, args)["step_s"])
            trl_s, ours_s = statistics.median(times["trl"]), statistics.median(times["trl_ext"])
            rows.append((setup, trainer, trl_s, ours_s))
            print(f"{setup:<17} {trainer:<7} TRL {trl_s:.4f}s  trl_ext {ours_s:.4f}s  ratio {ours_s / trl_s:.3f}  "
                  f"(runs: TRL {', '.join(f'{t:.4f}' for t in times['trl'])}; "
                  f"trl_ext {', '.join(f'{t:.4f}' for t in times['trl_ext'])})", flush=True)

    print("\nsetup              trainer   TRL step (s)   trl_ext step (s)   trl_ext / TRL")
    for setup, trainer, trl_s, ours_s in rows:
        print(f"{setup:<18} {trainer:<9} {trl_s:12.4f}   {ours_s:16.4f}   {ours_s / trl_s:13.3f}")


if __name__ == "__main__":
    main()
