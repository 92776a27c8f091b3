"""One GPU, one process: a ~0.5B model (Qwen2.5-0.5B's shape, random weights, bf16) trained with SFT and DPO, LoRA and
full fine-tuning, with and without gradient checkpointing, by TRL's trainers and by trl_ext's, in one run.

    python bench/gpu.py                                # all 8 workloads x {TRL, trl_ext}, on the visible GPU
    python bench/gpu.py --trainers sft --tunings lora  # a subset
    python bench/gpu.py --peak_tflops 989              # a GPU missing from TRL's peak table
    python bench/gpu.py --smoke                        # the same code on CPU with a tiny model, 3 steps (a check)

Each run is its own process (clean peak memory), sequence 1024, 8 sequences per step (DPO: 4 pairs, chosen and
rejected both counted), 20 steps of which the first 5 are skipped. Runs alternate TRL / trl_ext, the order flipping
every repeat. Printed per workload: tokens/s, peak GPU memory (torch.cuda.max_memory_allocated: weights, optimizer,
activations), model TFLOP/s and MFU against the GPU's dense bf16 peak, and trl_ext's step time over TRL's.
The FLOPs convention is in bench/_gpu_worker.py: 6N per trained token (4N for frozen weights), PaLM's attention term,
DPO's reference forward included, gradient-checkpointing recompute not counted.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("_gpu_worker.py")


def peak_tflops(device: str) -> float | None:
    """The device's dense bf16 peak from TRL's table (H100 SXM 989, H100 PCIe 756, H200 989, A100 312, L40S 362...)."""
    from trl.trainer.utils import get_peak_flops

    peak = get_peak_flops(device, "bfloat16")
    return peak / 1e12 if peak else None


def run(args: list[str], smoke: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if smoke else None
    done = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=1800,
                          check=False, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("BENCH ")]
    if done.returncode != 0 or not lines:
        sys.exit(f"run failed ({done.returncode}): {args}\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(lines[-1][6:])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", nargs="+", choices=["sft", "dpo"], default=["sft", "dpo"])
    parser.add_argument("--tunings", nargs="+", choices=["lora", "full"], default=["lora", "full"])
    parser.add_argument("--gc", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--impls", nargs="+", choices=["trl", "trl_ext"], default=["trl", "trl_ext"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--peak_tflops", type=float, help="the GPU's dense bf16 peak, if not in the table")
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 model on CPU, 3 steps: checks the script")
    cli = parser.parse_args()

    sizes = ["--steps", str(cli.steps), "--seq_len", str(cli.seq_len), "--batch", str(cli.batch)]
    if cli.smoke:
        sizes = ["--smoke", "--flop_check", "--steps", "3", "--warmup", "1", "--seq_len", "64", "--batch", "4"]
    rows = []
    for trainer in cli.trainers:
        for tuning in cli.tunings:
            for gc in cli.gc:
                runs = {impl: [] for impl in cli.impls}
                for repeat in range(cli.repeats):
                    for impl in cli.impls if repeat % 2 == 0 else cli.impls[::-1]:
                        args = ["--impl", impl, "--trainer", trainer, "--tuning", tuning, "--gc", gc, *sizes]
                        runs[impl].append(run(args, cli.smoke))
                        r = runs[impl][-1]
                        check = r["flop_check"]
                        print(f"{trainer} {tuning} gc={gc} {impl}: step {r['step_s']:.3f}s, "
                              f"{r['tokens_per_s']:.0f} tokens/s, {r['tokens_per_step']:.0f} tokens/step"
                              + (f"; FLOPs of one step, torch's counter / formula: {check['counted/formula']:.3f}"
                                 if check else ""), flush=True)
                rows.append((trainer, tuning, gc, runs))

    first = rows[0][3][cli.impls[0]][0]
    peak = cli.peak_tflops or peak_tflops(first["device"])
    print(f"\ndevice: {first['device']}; {first['params'] / 1e6:.3g}M parameters; dense bf16 peak: "
          f"{f'{peak:g} TFLOP/s' if peak else 'unknown (pass --peak_tflops for MFU)'}")
    print("trainer  tuning  GC   impl      tokens/s   peak mem (GiB)   TFLOP/s     MFU   step vs TRL")
    for trainer, tuning, gc, runs in rows:
        med = {impl: {k: statistics.median(r[k] for r in rs) for k in ("step_s", "tokens_per_s", "model_flops_per_s")}
               for impl, rs in runs.items()}
        for impl, rs in runs.items():
            mem = rs[0]["peak_mem_gib"]
            tflops = med[impl]["model_flops_per_s"] / 1e12
            mfu = f"{100 * tflops / peak:6.1f}%" if peak else "    n/a"
            ratio = f"{med[impl]['step_s'] / med['trl']['step_s']:.3f}" if "trl" in med else "n/a"
            print(f"{trainer:<8} {tuning:<7} {gc:<4} {impl:<8} {med[impl]['tokens_per_s']:9.0f}   "
                  f"{'n/a' if mem is None else f'{mem:.2f}':>14}   {tflops:7.3f}  {mfu}   {ratio:>11}")


if __name__ == "__main__":
    main()
