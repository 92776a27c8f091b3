"""Saving a full model under 2-process ZeRO-3 on CPU: trl_ext's save path vs transformers' Trainer.save_model.

    python bench/save.py [--repeats 2] [--layers 12]

The model is a random Llama with hidden 768, 12 layers and a 32k vocabulary (134M parameters, 537 MB in fp32), in
the embedded model's format. Both sides train one step under ZeRO-3 (gather flag on, as transformers' path needs)
and then save with shards of a quarter of the model. Runs alternate (transformers, trl_ext, ...); medians shown.
Memory: rank 0's peak RSS growth during the save, over its level just before it.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.harness import launch, write_accelerate_config

IMPLS = ["transformers", "trl_ext"]


def build_model(directory: Path, layers: int) -> int:
    """A random Llama with the embedded model's tokenizer; returns its size in bytes."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trl_ext.assets import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                         num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    cli = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-save-"))
    model_bytes = build_model(work / "model", cli.layers)
    shard = f"{model_bytes // 4 // 1000}KB"  # a quarter of the model; a unit both parsers accept
    print(f"model: {model_bytes / 1e6:.0f} MB; max_shard_size {shard}", flush=True)
    config = write_accelerate_config(work / "configs", "zero3")
    worker = Path(__file__).with_name("_save_worker.py")
    results = {impl: [] for impl in IMPLS}
    for repeat in range(cli.repeats):
        for impl in IMPLS:
            out = work / f"{impl}-{repeat}"
            run = launch(worker, ["--impl", impl, "--model", str(work / "model"), "--output_dir", str(out),
                                  "--max_shard_size", shard], config, timeout=900)
            lines = [line for line in run.output.splitlines() if line.startswith("BENCH ")]
            if run.returncode != 0 or not lines:
                sys.exit(f"{impl} run failed ({run.returncode}):\n{run.output[-3000:]}")
            results[impl].append(json.loads(lines[-1][6:]))
            r = results[impl][-1]
            print(f"repeat {repeat + 1} {impl:<13} save {r['save_s']:.2f}s  peak +{r['peak_growth_mb']:.0f} MiB  "
                  f"({r['params'] / 1e6:.0f}M params)", flush=True)

    med = {i: {k: statistics.median(r[k] for r in results[i]) for k in ("save_s", "peak_growth_mb")} for i in IMPLS}
    base = med["transformers"]
    print("\nimpl           save (s)   peak growth (MiB)   time vs transformers   memory vs transformers")
    for impl in IMPLS:
        print(f"{impl:<14} {med[impl]['save_s']:8.2f}   {med[impl]['peak_growth_mb']:17.0f}   "
              f"{med[impl]['save_s'] / base['save_s']:20.2f}   "
              f"{med[impl]['peak_growth_mb'] / max(base['peak_growth_mb'], 1e-9):22.2f}")


if __name__ == "__main__":
    main()
