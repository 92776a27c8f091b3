"""Loading a model under 2-process FSDP2 on CPU: each rank's peak RSS, with and without
``fsdp_cpu_ram_efficient_loading``.

    python bench/loading.py [--repeats 1] [--layers 12] [--trainer sft|dpo]

The model is bench/save.py's random Llama (134M parameters, 537 MB in fp32); ``--trainer dpo`` is a full fine-tune,
so TRL also loads the reference model from the same files. With the flag on, only rank 0 reads the weights: the
other ranks build the model on the meta device and receive their shards from rank 0 (transformers 5 alone reads them
on every rank, transformers#43749). Shown per rank: the bytes of weights read, peak RSS growth from just before the
trainer is built, in each phase (``load``: the trainer is built; ``shard``: accelerate shards the model and
broadcasts rank 0's weights; ``step``: the first step), the size of the rank's own parameter shards, and the growth
with the flag on over the growth with it off.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.harness, tests.probes

from save import build_model  # bench/save.py, beside this script

from tests.harness import accelerate_launch, write_accelerate_config


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--trainer", choices=["sft", "dpo"], default="sft")
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
            run = accelerate_launch(Path(__file__).with_name("_loading_worker.py"),
                         ["--model", str(work / "model"), "--trainer", cli.trainer,
                          "--output_dir", str(work / f"out-{efficient}-{repeat}")],
                         config, timeout=900)
            # both ranks print to one stream: a report may share its line with the other rank's
            lines = [json.JSONDecoder().raw_decode(part)[0] for part in run.output.split("BENCH ")[1:]]
            if run.returncode != 0 or len(lines) != 2:
                sys.exit(f"run failed ({run.returncode}):\n{run.output[-3000:]}")
            for line in lines:
                assert line["efficient"] == efficient, line
                results.setdefault((efficient, line["rank"]), []).append(line)
    phases = ("load", "shard", "step")
    growth = {(key, phase): statistics.median(r["growth_mb"][phase] for r in lines)
              for key, lines in results.items() for phase in phases}
    print(f"\n{cli.trainer}, peak RSS growth (MiB) per phase, and flag on / off")
    print("fsdp_cpu_ram_efficient_loading  rank  read (MiB)  own shards (MiB)  " + "  ".join(
        f"{phase:>6} {'on/off':>6}" for phase in phases))
    for (efficient, rank), lines in sorted(results.items(), reverse=True):
        cells = "  ".join(f"{growth[(efficient, rank), p]:6.0f} "
                          f"{growth[(efficient, rank), p] / growth[('false', rank), p]:6.2f}" for p in phases)
        print(f"{efficient:<31} {rank:>5}  {lines[0]['read_mb']:10.0f}  {lines[0]['local_params_mb']:16.0f}  {cells}")


if __name__ == "__main__":
    main()
