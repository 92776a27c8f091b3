"""Saving a full model under ZeRO-3 (or FSDP2) on CPU: trl_ext's save path, where every rank writes, in the
foreground and in the background, against the same path with one writing rank (as before) and transformers'
Trainer.save_model.

    python bench/save.py [--repeats 2] [--layers 12] [--hidden 768] [--moe] [--fsdp2] [--processes 4] [--impls ...]
    python bench/save.py --checkpoints [--engines zero2 zero3 fsdp2] [--processes 2] [--hidden 512 --layers 8]

With ``--checkpoints``: whole ``checkpoint-N``s of a full fine-tune with AdamW (weights, optimizer and scheduler
states, RNG states) every 2 steps of 9, foreground vs ``save_in_background``, under each engine: how long each
checkpoint holds the training loop (``_save_checkpoint``, plus the following step boundaries' checks), the first
checkpoint and the later ones (median), the one-time reserve at the end of the first step, the step time, the
training's wall time and rank 0's peak RSS growth; ratios against the foreground run of the same engine.

The model is a random Llama with hidden 768, 12 layers and a 32k vocabulary (134M parameters, 537 MB in fp32), in
the embedded model's format. Both sides train one step under ZeRO-3 (gather flag on, as transformers' path needs)
and then save with shards of a quarter of the model. Runs alternate (transformers, trl_ext, ...); medians shown.
"blocked" is how long training waits (the slowest rank; a foreground save blocks for all of it); "save" until the
save is committed on every rank. Each run saves twice, as a training run saves checkpoints: the table shows the second
save ("first" columns: a run's first save, which also plans the layout and allocates the background's CPU copy).
Memory: rank 0's peak RSS growth during the save, over its level just before it. With ``--moe``, a Qwen3-MoE
(hidden 512, 32 experts per layer, 581 MB for 4 layers) whose fused experts both sides convert back to the Hub's
per-expert tensors: trl_ext one layer's experts at a time. With ``--fsdp2``, under 2-process FSDP2
(accelerate_configs/fsdp2.yaml with ``fsdp_state_dict_type: FULL_STATE_DICT``, what transformers needs to write
loadable weights): trl_ext streams the DTensor shards, transformers gathers the full state dict on rank 0.
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.harness, tests.probes

from tests.harness import (
    accelerate_launch,
    print_ratio_table,
    write_accelerate_config,
)

IMPLS = ["transformers", "trl_ext-one-writer", "trl_ext", "trl_ext-background"]
ENGINES = ["zero2", "zero3", "fsdp2"]


def build_model(directory: Path, layers: int, moe: bool, hidden: int = 768) -> tuple[int, int]:
    """A random Llama (or Qwen3-MoE) with the embedded model's tokenizer; returns its size and its largest group of
    tensors converted together (one layer's experts), in bytes."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from trl_ext.assets import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    common = dict(vocab_size=32000, num_hidden_layers=layers, tie_word_embeddings=False, bos_token_id=None,
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    if moe:  # 32 experts of 3 x 512 x 512 per layer: 101 MB in fp32, the group converted at once
        config = Qwen3MoeConfig(hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_experts=32,
                                num_experts_per_tok=2, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
                                **common)
    else:
        config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                             num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, **common)
    torch.manual_seed(0)
    model = (Qwen3MoeForCausalLM if moe else LlamaForCausalLM)(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    groups = {}
    for name, p in model.named_parameters():
        groups[name.rpartition(".")[0]] = groups.get(name.rpartition(".")[0], 0) + p.numel() * p.element_size()
    largest = max(size for module, size in groups.items() if module.endswith("experts")) if moe else 0
    return sum(p.numel() * p.element_size() for p in model.parameters()), largest


def checkpoints_main(cli) -> None:
    """Whole checkpoints in a training run, foreground vs background, per engine (see the module docstring)."""
    import statistics

    work = Path(tempfile.mkdtemp(prefix="bench-checkpoints-"))
    model_bytes, _ = build_model(work / "model", cli.layers, False, cli.hidden)
    print(f"model: {model_bytes / 1e6:.0f} MB ({model_bytes // 4 / 1e6:.0f}M params, fp32); AdamW; "
          f"{cli.processes} processes", flush=True)
    worker = Path(__file__).with_name("_checkpoint_worker.py")
    for engine in cli.engines:
        config = write_accelerate_config(work / "configs" / engine, engine, cli.processes)
        results = {"foreground": [], "background": []}
        for repeat in range(cli.repeats):
            for variant in results:
                out = work / f"{engine}-{variant}-{repeat}"
                run = accelerate_launch(worker, ["--model", str(work / "model"), "--output_dir", str(out),
                                                 *(["--background"] if variant == "background" else [])],
                                        config, timeout=1800)
                lines = [line for line in run.output.splitlines() if line.startswith("BENCH ")]
                if run.returncode != 0 or not lines:
                    sys.exit(f"{engine} {variant} failed ({run.returncode}):\n{run.output[-3000:]}")
                r = json.loads(lines[-1][6:])
                shutil.rmtree(out, ignore_errors=True)  # its checkpoints: several GB a run
                # the last checkpoint (training's end) is written in the foreground in both variants
                r["first_s"], r["later_s"], r["last_s"] = (r["blocked"][0], statistics.median(r["blocked"][1:-1]),
                                                           r["blocked"][-1])
                results[variant].append(r)
                print(f"repeat {repeat + 1} {engine} {variant:<10} blocked per checkpoint "
                      f"{[round(b, 3) for b in r['blocked']]} s; reserve {r['reserve_s']:.3f} s; step "
                      f"{r['step_s']:.2f} s; total {r['total_s']:.1f} s; peak +{r['peak_mb']:.0f} MiB; CPU copies "
                      f"{r['copies_mb']:.0f} MiB", flush=True)
        print(f"\n{engine}, {cli.processes} processes:")
        print_ratio_table(results, {"first_s": "first checkpoint blocked (s)", "later_s": "later blocked (s)",
                                    "last_s": "last (foreground) blocked (s)", "step_s": "step (s)",
                                    "total_s": "total (s)", "peak_mb": "peak growth (MiB)"}, "foreground")
        med = {v: {k: statistics.median(r[k] for r in runs) for k in ("reserve_s", "copies_mb", "peak_mb")}
               for v, runs in results.items()}
        print(f"background: reserve at the end of the first step {med['background']['reserve_s']:.3f} s; rank 0's "
              f"CPU copies {med['background']['copies_mb']:.0f} MiB; its peak growth over the foreground's "
              f"{med['background']['peak_mb'] - med['foreground']['peak_mb']:.0f} MiB")

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768, help="Llama's hidden size (1536 with 16 layers: 0.55B)")
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE, whose experts are converted on save")
    parser.add_argument("--fsdp2", action="store_true", help="under FSDP2 instead of DeepSpeed ZeRO-3")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS, help="the variants to run (trl_ext, the "
                        "anchor of the ratios, always runs)")
    parser.add_argument("--checkpoints", action="store_true",
                        help="whole checkpoint-N's of a training run, foreground vs background (see above)")
    parser.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES, help="with --checkpoints")
    cli = parser.parse_args()
    if cli.checkpoints:
        return checkpoints_main(cli)
    impls = [impl for impl in IMPLS if impl in cli.impls or impl == "trl_ext"]

    work = Path(tempfile.mkdtemp(prefix="bench-save-"))
    model_bytes, group_bytes = build_model(work / "model", cli.layers, cli.moe, cli.hidden)
    shard = f"{model_bytes // 4 // 1000}KB"  # a quarter of the model; a unit both parsers accept
    print(f"model: {model_bytes / 1e6:.0f} MB; max_shard_size {shard}"
          + (f"; largest converted group (one layer's experts) {group_bytes / 2**20:.0f} MiB" if cli.moe else ""),
          flush=True)
    config = write_accelerate_config(work / "configs", "fsdp2" if cli.fsdp2 else "zero3", cli.processes)
    if cli.fsdp2:  # transformers writes loadable weights under FSDP only from a full state dict
        config.write_text(config.read_text().replace("SHARDED_STATE_DICT", "FULL_STATE_DICT"))
    worker = Path(__file__).with_name("_save_worker.py")
    results = {impl: [] for impl in impls}
    for repeat in range(cli.repeats):
        for impl in impls:
            out = work / f"{impl}-{repeat}"
            run = accelerate_launch(worker, ["--impl", impl, "--model", str(work / "model"), "--output_dir", str(out),
                                  "--max_shard_size", shard], config, timeout=900)
            lines = [line for line in run.output.splitlines() if line.startswith("BENCH ")]
            if run.returncode != 0 or not lines:
                sys.exit(f"{impl} run failed ({run.returncode}):\n{run.output[-3000:]}")
            results[impl].append(json.loads(lines[-1][6:]))
            r = results[impl][-1]
            r["busiest_share"] = max(r["written_per_rank"]) / model_bytes  # 0 for transformers (not counted)
            r["copy_share"] = max(r["copy_per_rank"]) / model_bytes  # background: the largest rank's CPU copy
            print(f"repeat {repeat + 1} {impl:<18} blocked {r['blocked_s']:.3f}s (first {r['first_blocked_s']:.3f}s)  "
                  f"save {r['save_s']:.2f}s  "
                  f"peak +{r['peak_growth_mb']:.0f} MiB  ({r['params'] / 1e6:.0f}M params); bytes written per "
                  f"rank / model: {[round(b / model_bytes, 3) for b in r['written_per_rank']]}; CPU copy per rank / "
                  f"model: {[round(b / model_bytes, 3) for b in r['copy_per_rank']]}", flush=True)

    print_ratio_table(results, {"blocked_s": "blocked (s)", "save_s": "save (s)",
                                "first_blocked_s": "first blocked (s)", "peak_growth_mb": "peak growth (MiB)",
                                "busiest_share": "busiest rank's bytes / model",
                                "copy_share": "largest CPU copy / model"}, "trl_ext")

if __name__ == "__main__":
    main()
