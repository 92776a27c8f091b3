"""One GPU, one process: a ~0.5B model (Qwen2.5-0.5B's shape, random weights, bf16) trained with SFT and DPO, LoRA and
full fine-tuning, with and without gradient checkpointing, by TRL's trainers and by trl_ext's, in one run.

    python bench/gpu.py                                # all 8 workloads x {TRL, trl_ext}, on the visible GPU
    python bench/gpu.py --trainers sft --tunings lora  # a subset
    python bench/gpu.py --peak_tflops 989              # a GPU missing from TRL's peak table
    python bench/gpu.py --smoke                        # the same code on CPU with a tiny model, 3 steps (a check)
    python bench/gpu.py --one_process --json out.json  # every run in one process; the table also as JSON
    python bench/gpu.py --gc on --repeats 2 --control dpo-full  # 2 alternated repeats, an A/A control for DPO full

Each run is its own process (clean peak memory; with ``--one_process`` all runs share one, which saves each one's
start-up: each run's peak is then measured from a reset after the earlier runs' memory was freed, and what was still
held is reported as held_before_bytes), sequence 1024, 8 sequences per step
(DPO: 4 pairs, chosen and rejected both counted), 20 steps of which the first 5 are skipped. Runs alternate TRL /
trl_ext, the order flipping every repeat (bench/_pairing.py, shared with bench/overhead.py), every workload's first
repeat before any second one; ``--control``: the same pairs again with TRL's trainer on both sides (an A/A control),
so that a ratio comes with its noise. Printed per workload: tokens/s, peak GPU memory
(torch.cuda.max_memory_allocated: weights, optimizer, activations), model TFLOP/s and MFU against the GPU's dense bf16
peak, trl_ext's step time over TRL's (the ratio of the medians), and the ratios repeat by repeat: their median and
range. A run that fails is reported and the others go on (exit code 1 at the end).
The FLOPs convention is in bench/_gpu_worker.py: 6N per trained token (4N for frozen weights), PaLM's attention term,
DPO's reference forward included, gradient-checkpointing recompute not counted.
"""

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _pairing, when imported from elsewhere

from _pairing import order as pairing_order  # noqa: E402 - the alternation bench/overhead.py uses too
from _pairing import span, summary  # noqa: E402

WORKER = Path(__file__).with_name("_gpu_worker.py")


def peak_tflops(device: str) -> float | None:
    """The device's dense bf16 peak from TRL's table (H100 SXM 989, H100 PCIe 756, H200 989, A100 312, L40S 362...)."""
    from trl.trainer.utils import get_peak_flops

    peak = get_peak_flops(device, "bfloat16")
    return peak / 1e12 if peak else None


def run(args: list[str], smoke: bool, record) -> None:
    """Run the worker; ``record(results, failure)`` as each of its BENCH lines arrives (one per workload of a
    ``--plan``: a run stopped early keeps those measured so far), and with its failure if it failed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if smoke else None
    tail, reported = collections.deque(maxlen=300), 0
    with subprocess.Popen([sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env) as proc:
        for line in proc.stdout:
            if line.startswith("BENCH "):
                record([json.loads(line[6:])], None)
                reported += 1
            elif line.startswith("BENCH_FAILED "):  # a workload of a --plan that failed while the others ran
                f = json.loads(line[13:])
                record([], f"run failed: {f['trainer']} {f['tuning']} gc={f['gc']} {f['impl']}\n{f['error']}")
                reported += 1
            else:
                tail.append(line)
    if (proc.returncode != 0 and reported == 0) or proc.returncode not in (0, 1):  # 1: BENCH_FAILED said why
        record([], f"run failed ({proc.returncode}): {args}\n{''.join(tail)[-3000:]}")


def side(impl: str, control: bool) -> str:
    """A side as the output names it: the A/A control's are "TRL (A/A, first)" and "TRL (A/A, second)"."""
    return f"TRL (A/A, {'first' if impl == 'trl' else 'second'})" if control else impl


def report(r: dict) -> None:
    check = r["flop_check"]
    print(f"{r['trainer']} {r['tuning']} gc={r['gc']} {side(r['impl'], r.get('control'))} (repeat {r.get('repeat')}, "
          f"run {r.get('run_s', 0):.1f} s of which build {r.get('build_s', 0):.1f} s): step {r['step_s']:.3f}s, "
          f"{r['tokens_per_s']:.0f} tokens/s, {r['tokens_per_step']:.0f} tokens/step"
          + (f"; FLOPs of one step, torch's counter / formula: {check['counted/formula']:.3f}" if check else ""),
          flush=True)


def paired(runs: dict[str, list[dict]]) -> dict | None:
    """The ratios of trl_ext's step over TRL's, repeat by repeat (each trl_ext run over the TRL run of its repeat),
    summed up (bench/_pairing.py); None without a repeat that ran both sides."""
    trl = {r["repeat"]: r["step_s"] for r in runs.get("trl", [])}
    ratios = [r["step_s"] / trl[r["repeat"]] for r in sorted(runs.get("trl_ext", []), key=lambda r: r["repeat"])
              if r["repeat"] in trl]
    return summary(ratios) if ratios else None


def table(results: list[dict], impls: list[str], peak: float | None) -> list[dict]:
    """One row per workload, implementation and control: medians over its runs, MFU against ``peak``, step time over
    TRL's (the ratio of the medians), and on trl_ext's side the ratios repeat by repeat (``paired``). The A/A
    control's rows have ``control`` True: TRL's trainer on both sides."""
    rows = []
    for key in dict.fromkeys((r["trainer"], r["tuning"], r["gc"], bool(r.get("control"))) for r in results):
        runs = {impl: [r for r in results if (r["trainer"], r["tuning"], r["gc"], bool(r.get("control")), r["impl"])
                       == (*key, impl)] for impl in impls}
        med = {impl: {k: statistics.median(r[k] for r in rs) for k in ("step_s", "tokens_per_s", "model_flops_per_s")}
               for impl, rs in runs.items() if rs}
        for impl, rs in runs.items():
            if not rs:
                continue
            mem = max((r["peak_mem_gib"] for r in rs if r["peak_mem_gib"] is not None), default=None)
            # the lowest peak of the runs goes to the device check's memory floor: any run below it was mismeasured
            low = min((r["peak_mem_bytes"] for r in rs if r.get("peak_mem_bytes") is not None), default=None)
            tflops = med[impl]["model_flops_per_s"] / 1e12
            rows.append({"trainer": key[0], "tuning": key[1], "gc": key[2], "impl": impl, "control": key[3],
                         "runs": len(rs), "paired": paired(runs) if impl == "trl_ext" else None,
                         "tokens_per_s": med[impl]["tokens_per_s"], "step_s": med[impl]["step_s"],
                         "peak_mem_gib": mem, "tflops": tflops, "mfu_percent": 100 * tflops / peak if peak else None,
                         "step_vs_trl": med[impl]["step_s"] / med["trl"]["step_s"] if "trl" in med else None,
                         "lowest_peak_mem_bytes": low, "held_before_bytes": max(r.get("held_before_bytes") or 0
                                                                                for r in rs),
                         "figures": next((r["figures"] for r in rs if r.get("figures")), None)})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", nargs="+", choices=["sft", "dpo"], default=["sft", "dpo"])
    parser.add_argument("--tunings", nargs="+", choices=["lora", "full"], default=["lora", "full"])
    parser.add_argument("--gc", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--impls", nargs="+", choices=["trl", "trl_ext"], default=["trl", "trl_ext"])
    parser.add_argument("--repeats", type=int, default=1, help="runs per side and workload, TRL first in even "
                        "repeats and trl_ext first in odd ones (bench/_pairing.py)")
    parser.add_argument("--control", nargs="+", default=[], metavar="TRAINER-TUNING",
                        help="workloads (e.g. dpo-full) that also run an A/A control in every repeat: TRL's trainer "
                        "on both sides, under the same alternation")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps not timed at the start of each run")
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--peak_tflops", type=float, help="the GPU's dense bf16 peak, if not in the table")
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 model on CPU, 3 steps: checks the script")
    parser.add_argument("--one_process", action="store_true", help="every run in one worker process")
    parser.add_argument("--json", help="also write the rows, the device and the peak used to this JSON file (after "
                        "each run: a run stopped early leaves the rows measured so far)")
    cli = parser.parse_args()

    sizes = ["--steps", str(cli.steps), "--warmup", str(cli.warmup), "--seq_len", str(cli.seq_len), "--batch",
             str(cli.batch)]
    if cli.smoke:
        sizes = ["--smoke", "--flop_check", "--steps", "3", "--warmup", "1", "--seq_len", "64", "--batch", "4"]
    # Every workload's first repeat before any second one: a run stopped early (the device check's time limit)
    # keeps whole repeats, and drift over the run spreads over every workload. Within a repeat each workload's pair,
    # then its A/A pair, in the repeat's order.
    controls = {tuple(c.split("-")) for c in cli.control}
    plan = []
    for repeat in range(cli.repeats):
        for trainer in cli.trainers:
            for tuning in cli.tunings:
                for gc in cli.gc:
                    for control in (False, True) if (trainer, tuning) in controls else (False,):
                        # the FLOPs formula (--smoke) is the same in every repeat: checked in the first only
                        once = {} if repeat == 0 and not control else {"flop_check": False}
                        plan += [{"trainer": trainer, "tuning": tuning, "gc": gc, "impl": impl, "control": control,
                                  "repeat": repeat, **once} for impl in pairing_order(repeat) if impl in cli.impls]
    results, failures, peak = [], [], cli.peak_tflops

    def record(found: list[dict], failed: str | None) -> None:
        nonlocal peak
        for r in found:
            report(r)
        results.extend(found)
        if failed:
            print(failed, file=sys.stderr, flush=True)
            failures.append(failed)
        if results and peak is None and results[0]["device"] != "cpu":  # (TRL's import takes seconds)
            peak = peak_tflops(results[0]["device"])
        if cli.json:
            Path(cli.json).write_text(json.dumps({
                "device": results[0]["device"] if results else None, "params": results[0]["params"] if results
                else None, "peak_tflops": peak, "rows": table(results, cli.impls, peak), "runs": results,
                "failures": failures}))

    if cli.one_process:
        run(["--plan", json.dumps(plan), *sizes], cli.smoke, record)
    else:
        for w in plan:
            run(["--impl", w["impl"], "--trainer", w["trainer"], "--tuning", w["tuning"], "--gc", w["gc"], "--repeat",
                 str(w["repeat"]), *(["--control"] if w["control"] else []), *sizes], cli.smoke, record)
    if not results:
        sys.exit("no run finished")
    first = results[0]
    print(f"\ndevice: {first['device']}; {first['params'] / 1e6:.3g}M parameters; dense bf16 peak: "
          f"{f'{peak:g} TFLOP/s' if peak else 'unknown (pass --peak_tflops for MFU)'}")
    print("trainer  tuning  GC   impl                 runs   tokens/s   peak mem (GiB)   TFLOP/s     MFU   step vs TRL"
          "   paired: median (range)")
    for row in table(results, cli.impls, peak):
        mem, mfu, ratio, pairs = row["peak_mem_gib"], row["mfu_percent"], row["step_vs_trl"], row["paired"]
        print(f"{row['trainer']:<8} {row['tuning']:<7} {row['gc']:<4} {side(row['impl'], row['control']):<20} "
              f"{row['runs']:4d}   {row['tokens_per_s']:8.0f}   {'n/a' if mem is None else f'{mem:.2f}':>14}   "
              f"{row['tflops']:7.3f}  {'    n/a' if mfu is None else f'{mfu:6.1f}%'}   "
              f"{'n/a' if ratio is None else f'{ratio:.3f}':>11}   "
              + (f"{pairs['median']:.3f} ({span(pairs)})" if pairs else "-"))
    if failures:
        sys.exit(f"{len(failures)} run(s) failed (above)")


if __name__ == "__main__":
    main()
