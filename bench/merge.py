"""Merging a LoRA adapter into a >= 1B base: trl-ext merge (streamed) vs PEFT's merge_and_unload + save_pretrained.

    python bench/merge.py [--layers 22] [--repeats 1] [--workdir DIR]

The base is a TinyLlama-1.1B-shaped Llama (hidden 2048, 22 layers, vocabulary 32000; 1.1B parameters) with random
weights, saved by transformers in bf16 (2.2 GB, one file); the adapter is LoRA r=64 on every linear layer (fp32, as
PEFT creates it on a bf16 model). Each side runs in its own process, one after the other (the order flips every
repeat), and is measured from outside: wall time and peak RSS (``os.wait4``). Inside, each reports the time after its
imports and the RSS at that point, which gives the merge's own time and peak above the interpreter and libraries.
- PEFT: ``AutoModelForCausalLM.from_pretrained(base, dtype=bfloat16)``, ``PeftModel.from_pretrained``,
  ``merge_and_unload()``, ``save_pretrained(out)``.
- trl_ext: ``trl-ext merge --adapter A --base B --out O`` (the CLI's function, in-process): streamed, checked per
  tensor, verified, fsynced and committed (PEFT's save does not fsync).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = Path(__file__).with_name("_merge_worker.py")
ROOT = Path(__file__).resolve().parent.parent


def run(mode: str, args: list[str]) -> dict:
    """One worker process: its report, wall time and peak RSS."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRANSFORMERS_VERBOSITY": "error"}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(WORKER), mode, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - started
    lines = [line for line in output.splitlines() if line.startswith("BENCH ")]
    if os.waitstatus_to_exitcode(status) != 0 or not lines:
        sys.exit(f"{mode} failed:\n{output[-4000:]}")
    report = json.loads(lines[-1][6:])
    report.update(wall=wall, peak_rss=usage.ru_maxrss * 1024)
    report["peak_above_imports"] = report["peak_rss"] - report["rss_after_imports"]
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--workdir", help="keep the base and adapter here (built once, reused)")
    cli = parser.parse_args()

    work = Path(cli.workdir or tempfile.mkdtemp(prefix="bench-merge-"))
    base, adapter = work / "base", work / "adapter"
    if not (adapter / "adapter_config.json").exists():
        built = run("build", ["--base", str(base), "--adapter", str(adapter), "--layers", str(cli.layers)])
        print(f"built in {built['wall']:.0f}s: {built['params'] / 1e9:.2f}B parameters, adapter "
              f"{built['adapter_params'] / 1e6:.1f}M parameters", flush=True)
    size = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    adapter_size = sum(f.stat().st_size for f in adapter.glob("*.safetensors"))
    print(f"base {size / 1e9:.2f} GB (bf16), adapter {adapter_size / 1e6:.0f} MB", flush=True)

    results = {"peft": [], "trl_ext": []}
    for repeat in range(cli.repeats):
        for impl in (["peft", "trl_ext"] if repeat % 2 == 0 else ["trl_ext", "peft"]):
            out = work / f"out-{impl}"
            shutil.rmtree(out, ignore_errors=True)
            r = run(impl, ["--base", str(base), "--adapter", str(adapter), "--out", str(out)])
            results[impl].append(r)
            print(f"repeat {repeat + 1} {impl:<8} wall {r['wall']:6.1f}s  merge {r['seconds']:6.1f}s  peak RSS "
                  f"{r['peak_rss'] / 2**30:5.2f} GiB  above imports {r['peak_above_imports'] / 2**30:5.2f} GiB",
                  flush=True)
            shutil.rmtree(out, ignore_errors=True)

    def best(impl, key):
        return statistics.median(r[key] for r in results[impl])

    print("\n| measure | PEFT merge_and_unload + save_pretrained | trl-ext merge | ratio |\n|---|---|---|---|")
    measures = [("wall", "wall time, whole process", "s", 1), ("seconds", "time after imports", "s", 1),
                ("peak_rss", "peak RSS, whole process", "GiB", 2**30),
                ("peak_above_imports", "peak RSS above the imports", "GiB", 2**30)]
    for key, label, unit, scale in measures:
        peft, ours = best("peft", key), best("trl_ext", key)
        print(f"| {label} | {peft / scale:.2f} {unit} | {ours / scale:.2f} {unit} | **{ours / peft:.3f}** |")
    if not cli.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
