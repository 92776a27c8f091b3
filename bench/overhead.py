"""trl_ext's trainers vs TRL's on the same workload: steady-state step time, in one run.

    python bench/overhead.py [--repeats 2] [--steps 30] [--trainers sft reward dpo] [--setups 1proc zero3 fsdp2]
    python bench/overhead.py --count_calls    # the Python calls of two steps, TRL vs trl_ext, function by function
    python bench/overhead.py --control --setups 1proc    # A/A: TRL against TRL in the same pairing (its own bias)
    python bench/overhead.py --gc --trainers dpo --setups 1proc --adapters lora full --with_control

SFT, Reward and DPO, LoRA (all-linear, r=8; ``--adapters full``: a full fine-tuning) on a random Llama (hidden 256,
4 layers, sequence 128, batch 4 per rank), one thread per process. Gradient checkpointing is off unless ``--gc``: then
each side checkpoints as it sets it up (trl_ext: ``use_reentrant=False``; TRL's DPO leaves it to transformers, whose
default in 5.24 is non-reentrant too); bench/gradient_checkpointing.py compares the modes alone. ``--with_control``
(1 process): each row also runs the A/A control under the same settings and prints its paired ratio and range
beside, so that a ratio comes with its noise (the alternation and the ratios: bench/_pairing.py, which bench/gpu.py
shares).
A step is a whole loop iteration (forward, backward, optimizer, callbacks, next batch).
- 1 process: each run holds a TRL trainer and a trl_ext trainer that take turns step by step (threads passing a
  baton; who starts alternates between repeats), so every trl_ext step has a TRL step beside it under the same
  machine load. Ratio: median over all steps of (trl_ext step / its paired TRL step), and the ratio of the medians.
- 2-process ZeRO-3 on CPU (`stage3_param_persistence_threshold: 0`), and 2-process FSDP2 (accelerate_configs/
  fsdp2.yaml; the worker builds TRL's trainer from trl_ext's config too, so both get FSDP on CPU): two engines in
  one process are not a supported setup, so runs alternate TRL / trl_ext with the order flipped every repeat (TRL,
  trl_ext, trl_ext, TRL, ...). Each run's step time is the median of its steps; ratio: median of the per-repeat
  ratios, and the ratio of the medians. Whole runs see different load on a shared machine: this setup needs many
  repeats there.
The first 4 steps of every run are skipped.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.harness, tests.probes
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _pairing, when imported from elsewhere

from _pairing import order, span, summary  # noqa: E402 - the alternation and ratios bench/gpu.py shares

from tests.harness import accelerate_launch, write_accelerate_config  # noqa: E402

WORKER = Path(__file__).with_name("_overhead_worker.py")
SETUPS = {"1proc": "1 process", "zero3": "2-process ZeRO-3", "fsdp2": "2-process FSDP2"}


def run(setup: str, configs: dict[str, Path], worker_args: list[str]) -> dict:
    if setup == "1proc":  # one thread, as each rank of the launched runs gets (bench/_harness.py)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, str(WORKER), *worker_args], capture_output=True, text=True,
                              timeout=900, check=False, env=env)
        code, output = done.returncode, done.stdout + done.stderr
    else:
        result = accelerate_launch(WORKER, worker_args, configs[setup], timeout=900)
        code, output = result.returncode, result.output
    lines = [line for line in output.splitlines() if line.startswith("BENCH ")]
    if code != 0 or not lines:
        sys.exit(f"run failed ({code}): {worker_args}\n{output[-3000:]}")
    return json.loads(lines[-1][6:])


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def count_calls(cli, configs: dict[str, Path]) -> None:
    """The work of a step, function by function: every Python call in steps 5 and 6, TRL's trainer vs trl_ext's."""
    for setup in cli.setups:
        for trainer in cli.trainers:
            calls = {impl: run(setup, configs, ["--impl", impl, "--trainer", trainer, "--steps", "8", "--warmup", "0",
                                               "--count_calls"])["calls"] for impl in ("trl", "trl_ext")}
            differ = {name: calls["trl_ext"].get(name, 0) - calls["trl"].get(name, 0)
                      for name in set(calls["trl"]) | set(calls["trl_ext"])}
            differ = {name: n for name, n in differ.items() if n}
            top = ", ".join(f"{name} {n:+d}" for name, n in sorted(differ.items(), key=lambda kv: -abs(kv[1]))[:5])
            print(f"{SETUPS[setup]:<17} {trainer:<7} calls in 2 steps: TRL {sum(calls['trl'].values())}, trl_ext "
                  f"{sum(calls['trl_ext'].values())}; functions called a different number of times: {len(differ)}"
                  + (f" ({top})" if top else ""), flush=True)


def paired_1proc(cli, configs: dict[str, Path], worker_args: list[str], control: bool) -> tuple[list, list]:
    """Both trainers in each run, alternating step by step (who starts alternates between repeats): every TRL step
    and every trl_ext step (``control``: TRL's trainer on both sides)."""
    trl_steps, ours_steps = [], []
    for repeat in range(cli.repeats):
        first = order(repeat)[0]
        times = run("1proc", configs, ["--impl", "both", *worker_args, "--steps", str(cli.steps), "--first", first,
                                       *(["--control"] if control else [])])
        trl_steps += times["times"]["trl"]
        ours_steps += times["times"]["trl_ext"]
    return trl_steps, ours_steps


def whole_runs(cli, configs: dict[str, Path], setup: str, worker_args: list[str]) -> tuple[list, list]:
    """Whole runs alternating, the order flipped every repeat: each run's median step."""
    trl_steps, ours_steps = [], []
    for repeat in range(cli.repeats):
        for impl in order(repeat):
            args = ["--impl", impl, *worker_args, "--steps", str(max(cli.steps // 2, 8))]
            step = statistics.median(run(setup, configs, args)["times"][impl])
            (trl_steps if impl == "trl" else ours_steps).append(step)
    return trl_steps, ours_steps


def measure(cli, configs: dict[str, Path], setup: str, trainer: str, adapter: str) -> tuple:
    """One row: TRL's and trl_ext's median step, the median paired ratio, its range, and the A/A control's median
    paired ratio and range ("-" without ``--with_control``)."""
    worker_args = ["--trainer", trainer, *(["--gc"] if cli.gc else []), *(["--full"] if adapter == "full" else [])]
    control = "-"
    if setup == "1proc":
        trl_steps, ours_steps = paired_1proc(cli, configs, worker_args, cli.control)
        paired = [o / t for o, t in zip(ours_steps, trl_steps)]  # each trl_ext step / the TRL step beside it
        runs = f"{len(paired)} step pairs"
        if cli.with_control and not cli.control:
            aa_trl, aa_other = paired_1proc(cli, configs, worker_args, control=True)
            aa = summary([o / t for o, t in zip(aa_other, aa_trl)])
            control = f"{aa['median']:.3f} ({span(aa)})"
    else:
        trl_steps, ours_steps = whole_runs(cli, configs, setup, worker_args)
        paired = [o / t for o, t in zip(ours_steps, trl_steps)]
        runs = (f"runs: TRL {', '.join(f'{t:.3f}' for t in trl_steps)}; "
                f"trl_ext {', '.join(f'{t:.3f}' for t in ours_steps)}")
    trl_s, ours_s = statistics.median(trl_steps), statistics.median(ours_steps)
    ratios = summary(paired)
    median_paired, spread = ratios["median"], span(ratios)
    print(f"{SETUPS[setup]:<17} {trainer:<7} {adapter:<5} TRL {trl_s:.4f}s  trl_ext {ours_s:.4f}s  "
          f"ratio {ours_s / trl_s:.3f}  paired {median_paired:.3f} ({spread}; {runs}; A/A {control}; {load()})",
          flush=True)
    return setup, trainer, adapter, trl_s, ours_s, median_paired, spread, control


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="steps per trainer and run (ZeRO-3: half)")
    parser.add_argument("--trainers", nargs="+", default=["sft", "reward", "dpo"])
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--adapters", nargs="+", choices=["lora", "full"], default=["lora"])
    parser.add_argument("--gc", action="store_true", help="gradient checkpointing on, on both sides")
    parser.add_argument("--control", action="store_true",
                        help="A/A control, 1 process: TRL's trainer on both sides, so the ratios show the pairing's "
                             "own bias (which side is built second, runs second, ...)")
    parser.add_argument("--with_control", action="store_true",
                        help="1 process: each row also runs the A/A control, its paired ratio printed beside")
    parser.add_argument("--count_calls", action="store_true",
                        help="instead of timing: compare the Python calls of two steps, TRL vs trl_ext")
    cli = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    configs = {setup: write_accelerate_config(work / setup, setup) for setup in ("zero3", "fsdp2")}
    print(f"start: {load()} on {os.cpu_count()} CPUs; gradient checkpointing {'on' if cli.gc else 'off'}", flush=True)
    if cli.control:
        print("A/A control: the 'trl_ext' column runs TRL's trainer too; a ratio away from 1.00 is the harness's bias")
    if cli.count_calls:
        return count_calls(cli, configs)
    rows = [measure(cli, configs, setup, trainer, adapter)
            for setup in cli.setups for trainer in cli.trainers for adapter in cli.adapters]
    print(f"\nend: {load()}")
    print("setup              trainer   adapter   TRL step (s)   trl_ext step (s)   ratio of medians   "
          "median paired ratio   paired range   A/A paired ratio (range)")
    for setup, trainer, adapter, trl_s, ours_s, paired, spread, control in rows:
        print(f"{SETUPS[setup]:<18} {trainer:<9} {adapter:<9} {trl_s:12.4f}   {ours_s:16.4f}   {ours_s / trl_s:16.3f}"
              f"   {paired:19.3f}   {spread:>12}   {control:>24}")


if __name__ == "__main__":
    main()
