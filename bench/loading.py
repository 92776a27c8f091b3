"""Loading a model under 2-process FSDP2 on CPU: each rank's peak RSS, with and without
``fsdp_cpu_ram_efficient_loading``.

    python bench/loading.py [--repeats 1] [--layers 12]

The model is bench/save.py's random Llama (134M parameters, 537 MB in fp32). With the flag on, only rank 0 should
read the weights: the other ranks build the model on the meta device and receive their shards from rank 0
(transformers#43749 reports runs where every rank loads it anyway). Shown per rank: peak RSS growth from just before
the trainer is built to the end of its first step, and the size of the rank's own parameter shards.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from _harness import launch, write_accelerate_config  # bench/_harness.py, beside this script
from save import build_model  # bench/save.py, beside this script


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--layers", type=int, default=12)
    cli = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-loading-"))
    model_bytes, _ = build_model(work / "model", cli.layers, moe=False)
    print(f"model: {model_bytes / 2**20:.0f} MiB", flush=True)
    results = {}
    for efficient in ("true", "false"):
        config = write_accelerate_config(work / f"configs-{efficient}", "fsdp2")
        config.write_text(config.read_text().replace("fsdp_cpu_ram_efficient_loading: true",
                                                     f"fsdp_cpu_ram_efficient_loading: {efficient}"))
        for repeat in range(cli.repeats):
            run = launch(Path(__file__).with_name("_loading_worker.py"),
                         ["--model", str(work / "model"), "--output_dir", str(work / f"out-{efficient}-{repeat}")],
                         config, timeout=900)
            lines = [json.loads(line[6:]) for line in run.output.splitlines() if line.startswith("BENCH ")]
            if run.returncode != 0 or len(lines) != 2:
                sys.exit(f"run failed ({run.returncode}):\n{run.output[-3000:]}")
            for line in lines:
                assert line["efficient"] == efficient, line
                results.setdefault((efficient, line["rank"]), []).append(line)
    print("\nfsdp_cpu_ram_efficient_loading   rank   peak RSS growth (MiB)   own shards (MiB)   growth / model size")
    for (efficient, rank), lines in sorted(results.items()):
        growth = statistics.median(r["peak_growth_mb"] for r in lines)
        print(f"{efficient:<32} {rank:>4}   {growth:21.0f}   {lines[0]['local_params_mb']:16.0f}   "
              f"{growth / (model_bytes / 2**20):19.2f}")


if __name__ == "__main__":
    main()
