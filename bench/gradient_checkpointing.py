"""Gradient checkpointing on CPU, 2-process ZeRO-3 + LoRA: none vs reentrant vs non-reentrant, in one run.

    python bench/gradient_checkpointing.py [--repeats 2] [--steps 8]
    python bench/gradient_checkpointing.py --hidden 2048 --layers 4 --seq_len 32 --probe [--full] [--backend fsdp2]
    python bench/gradient_checkpointing.py --gpu_0p5b        # one GPU, single process, ~0.5B model in bf16

Runs are interleaved (none, reentrant, non-reentrant, none, ...) and the median of the repeats is reported.
Memory is rank 0's peak RSS growth during training (activations and their recomputation dominate it here); the
all-gathered elements are rank 0's per optimizer step (ZeRO-3's coordinator or FSDP2's unshard), a count.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.harness, tests.probes

from tests.harness import (
    accelerate_launch,
    print_ratio_table,
    write_accelerate_config,
)

MODES = ["none", "reentrant", "non-reentrant"]


def run_single(worker, args):
    import subprocess

    done = subprocess.run([sys.executable, str(worker), *args], capture_output=True, text=True, timeout=900,
                          check=False)
    return type("Run", (), {"returncode": done.returncode, "output": done.stdout + done.stderr})()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    parser.add_argument("--probe", action="store_true", help="peak RSS per phase; ZeRO-3 gathering during recompute")
    parser.add_argument("--backend", choices=["zero3", "fsdp2"], default="zero3")
    parser.add_argument("--gpu_0p5b", action="store_true", help="single-process GPU variant, ~0.5B parameters")
    parser.add_argument("--tensor_peak", action="store_true",
                        help="peak bytes of live tensors (tests/probes/tensor_peak.py), a count free of allocator "
                             "noise; slows the steps, so timings are then not comparable")
    cli = parser.parse_args()

    config = write_accelerate_config(Path(tempfile.mkdtemp(prefix="bench-gc-")), cli.backend)
    worker = Path(__file__).with_name("_gradient_checkpointing_worker.py")
    results = {mode: [] for mode in MODES}
    for repeat in range(cli.repeats):
        for mode in MODES:
            worker_args = ["--mode", mode, "--steps", str(cli.steps), "--hidden", str(cli.hidden), "--layers",
                           str(cli.layers), "--seq_len", str(cli.seq_len)]
            worker_args += [f"--{flag}" for flag in ("full", "probe", "gpu_0p5b", "tensor_peak") if getattr(cli, flag)]
            run = (run_single(worker, worker_args) if cli.gpu_0p5b
                   else accelerate_launch(worker, worker_args, config, 900))
            lines = [line for line in run.output.splitlines() if line.startswith("BENCH ")]
            if run.returncode != 0 or not lines:
                sys.exit(f"{mode} run failed ({run.returncode}):\n{run.output[-3000:]}")
            results[mode].append(json.loads(lines[-1][6:]))
            print(f"repeat {repeat + 1} {mode:<14} step {results[mode][-1]['step_s']:.3f}s  "
                  f"peak +{results[mode][-1]['peak_growth_mb']:.0f} MiB  all-gathered "
                  f"{results[mode][-1]['gathered_per_step'] / 1e6:.2f}M elements per step "
                  f"({results[mode][-1]['gathered_per_step'] / results[mode][-1]['model_numel']:.2f}x the model)",
                  flush=True)
            if "tensor_peak_mb" in results[mode][-1]:
                print(f"  live tensors peak {results[mode][-1]['tensor_peak_mb']:.1f} MiB", flush=True)
            if "probe" in results[mode][-1]:
                print("  probe " + json.dumps(results[mode][-1]["probe"]), flush=True)

    columns = {"step_s": "step (s)", "peak_growth_mb": "peak growth (MiB)",
               "gathered_per_step": "all-gathered per step (elements)"}
    if cli.tensor_peak:
        columns["tensor_peak_mb"] = "live tensors peak (MiB)"
    print_ratio_table(results, columns, "reentrant")

if __name__ == "__main__":
    main()
