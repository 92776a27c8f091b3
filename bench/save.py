"""Saving a full model under ZeRO-3 (or FSDP2) on CPU: trl_ext's save path, where every rank writes, in the
foreground and in the background, against the same path with one writing rank (what spreading the writes is measured
against) and transformers' Trainer.save_model.

    python bench/save.py [--repeats 2] [--layers 12] [--hidden 768] [--moe] [--fsdp2] [--processes 4] [--impls ...]
    python bench/save.py --checkpoints [--engines zero2 zero3 fsdp2] [--processes_list 2 4] [--hidden 512 --layers 8]

With ``--checkpoints``: whole ``checkpoint-N``s of a full fine-tune with AdamW (weights, optimizer and scheduler
states, RNG states) every 2 steps of 9, under each engine and number of processes: the same run without checkpoints,
with them in the foreground, and with ``save_in_background``. How long each checkpoint holds training, as the trainer
logs it (``checkpoint/held_s``: inside ``_save_checkpoint``, plus the wait for its copies before the next optimizer
step, plus any wait for the previous checkpoint), the first checkpoint and the later ones (median), the training's
wall time in the three runs, the step after a background checkpoint, the one-time reserve at the end of the first step
and rank 0's CPU copies.

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
    """Whole checkpoints in a training run: none, in the foreground, in the background, per engine and number of
    processes (see the module docstring)."""
    import statistics

    work = Path(tempfile.mkdtemp(prefix="bench-checkpoints-"))
    model_bytes, _ = build_model(work / "model", cli.layers, False, cli.hidden)
    print(f"model: {model_bytes / 1e6:.0f} MB ({model_bytes // 4 / 1e6:.0f}M params, fp32); AdamW; {cli.steps} "
          f"steps, a checkpoint every {cli.save_steps}", flush=True)
    worker = Path(__file__).with_name("_whole_checkpoints_worker.py")
    variants = {"none": ["--save_steps", "0"], "foreground": [], "background": ["--background"]}
    rows = []
    for processes in cli.processes_list:
        for engine in cli.engines:
            config = write_accelerate_config(work / "configs" / f"{engine}-{processes}", engine, processes)
            results = {v: [] for v in variants}
            for repeat in range(cli.repeats):
                for variant, extra in variants.items():
                    out = work / f"{engine}-{processes}-{variant}-{repeat}"
                    run = accelerate_launch(worker, ["--model", str(work / "model"), "--output_dir", str(out),
                                                     "--steps", str(cli.steps), "--save_steps", str(cli.save_steps),
                                                     *extra], config, timeout=1800)
                    lines = [line for line in run.output.splitlines() if line.startswith("BENCH ")]
                    if run.returncode != 0 or not lines:
                        sys.exit(f"{engine} {variant} failed ({run.returncode}):\n{run.output[-3000:]}")
                    r = json.loads(lines[-1][6:])
                    shutil.rmtree(out, ignore_errors=True)  # its checkpoints: several GB a run
                    results[variant].append(r)
                    held = [round(c["checkpoint/held_s"], 3) for c in r["checkpoints"]]
                    print(f"{engine} x{processes} {variant:<10} repeat {repeat + 1}: held per checkpoint {held} s; "
                          f"total {r['total_s']:.1f} s; median step {statistics.median(r['steps']):.2f} s",
                          flush=True)
            rows.append(_checkpoint_row(engine, processes, results, cli.save_steps))
            _print_checkpoint_row(rows[-1])
    print("\n| engine, processes | fg held first, later (s) | bg held first, later (s) = in the save + copy wait "
          "| bg/fg first, later | wall: none, fg, bg (s) | bg/fg wall | bg/none wall | rank-0 copies (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['engine']}, {row['processes']} | {row['fg_first']:.2f}, {row['fg_later']:.2f} | "
              f"{row['bg_first']:.3f}, {row['bg_later']:.3f} = {row['bg_save']:.3f} + {row['bg_wait']:.3f} | "
              f"{row['bg_first'] / row['fg_first']:.3f}x, {row['bg_later'] / row['fg_later']:.3f}x | "
              f"{row['none_s']:.1f}, {row['fg_s']:.1f}, {row['bg_s']:.1f} | {row['bg_s'] / row['fg_s']:.2f}x | "
              f"{row['bg_s'] / row['none_s']:.2f}x | {row['copies_mb']:.0f} |")


def _checkpoint_row(engine: str, processes: int, results: dict, save_steps: int) -> dict:
    """Medians over the repeats: the first checkpoint's hold and the later ones' (the middle checkpoints: the last is
    written in the foreground in both variants), in the background split into the save and the copy wait."""
    import statistics

    def middle(run):  # the background checkpoints after the first
        return run["checkpoints"][1:-1]

    def med(values):
        return statistics.median(values)

    fg, bg = results["foreground"], results["background"]
    return {"engine": engine, "processes": processes,
            "fg_first": med([r["checkpoints"][0]["checkpoint/held_s"] for r in fg]),
            "fg_later": med([c["checkpoint/held_s"] for r in fg for c in middle(r)]),
            "bg_first": med([r["checkpoints"][0]["checkpoint/held_s"] for r in bg]),
            "bg_later": med([c["checkpoint/held_s"] for r in bg for c in middle(r)]),
            "bg_save": med([c["checkpoint/held_save_s"] for r in bg for c in r["checkpoints"][:-1]]),
            "bg_wait": med([c["checkpoint/held_copy_wait_s"] for r in bg for c in r["checkpoints"][:-1]]),
            "bg_write": med([c["checkpoint/write_s"] for r in bg for c in r["checkpoints"][:-1]]),
            "none_s": med([r["total_s"] for r in results["none"]]), "fg_s": med([r["total_s"] for r in fg]),
            "bg_s": med([r["total_s"] for r in bg]),
            # the step right after a checkpoint, against the median step of the run without checkpoints
            "bg_step_after": med([r["steps"][s] for r in bg for s in range(save_steps, len(r["steps"]) - 1,
                                                                            save_steps)]),
            "none_step": med([s for r in results["none"] for s in r["steps"]]),
            "reserve_s": med([r["reserve_s"] for r in bg]), "copies_mb": med([r["copies_mb"] for r in bg])}


def _print_checkpoint_row(row: dict) -> None:
    r = row
    print(f"\n{r['engine']}, {r['processes']} processes: held by a checkpoint, foreground first {r['fg_first']:.3f} s, "
          f"later {r['fg_later']:.3f} s; background first {r['bg_first']:.3f} s, later {r['bg_later']:.3f} s "
          f"({r['bg_first'] / r['fg_first']:.3f}x, {r['bg_later'] / r['fg_later']:.3f}x; in the save "
          f"{r['bg_save']:.3f} s + waiting for the copies {r['bg_wait']:.3f} s; its write {r['bg_write']:.2f} s "
          f"meanwhile). Wall time: no checkpoints {r['none_s']:.1f} s, foreground {r['fg_s']:.1f} s "
          f"({r['fg_s'] / r['none_s']:.2f}x), background {r['bg_s']:.1f} s ({r['bg_s'] / r['none_s']:.2f}x; "
          f"{r['bg_s'] / r['fg_s']:.2f}x the foreground's). The step after a background checkpoint "
          f"{r['bg_step_after']:.2f} s against {r['none_step']:.2f} s without checkpoints; reserve "
          f"{r['reserve_s']:.2f} s once; rank 0's CPU copies {r['copies_mb']:.0f} MiB.", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768, help="Llama's hidden size (1536 with 16 layers: 0.55B)")
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE, whose experts are converted on save")
    parser.add_argument("--fsdp2", action="store_true", help="under FSDP2 instead of DeepSpeed ZeRO-3")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--processes_list", type=int, nargs="+", default=[2], help="with --checkpoints")
    parser.add_argument("--steps", type=int, default=9, help="with --checkpoints: training steps")
    parser.add_argument("--save_steps", type=int, default=2, help="with --checkpoints: a checkpoint every N steps")
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
