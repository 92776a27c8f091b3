"""What a memory checkpoint holds training at a model larger than the tests' tiny one, against a foreground disk
checkpoint taken by the same process (the anchor), and whether the memory tier changes what is trained.

    python bench/memory_held.py [--every 8] [--steps 25] [--repeats 2]

One process on the CPU, a random 70M Llama (bench/_device_whole_checkpoints.py's ``--cpu`` shape: a whole checkpoint
with AdamW's states is 0.86 GB), full SFT in fp32, 2 x 64 tokens a step. Two runs, alternated ``--repeats`` times:

- ``foreground``: a disk checkpoint every ``--every`` steps, in the foreground (Trainer's own way);
- ``memory``: a memory checkpoint every ``--every`` steps (``memory_checkpoint_steps``) in a temporary
  ``TRL_EXT_MEMORY_DIR`` under /dev/shm, and no disk checkpoint before the final save.

Held time is trl_ext's own figure for each checkpoint (logged as ``checkpoint/held_s``, ``memory_checkpoint/held_s``:
from the end of the step to training going on, the copies included); the final save, always in the foreground, is
not counted. ``--every`` steps must outlast a memory checkpoint's write (``memory_checkpoint/write_s``, printed), or
the next one waits for it. Each run's whole ``train()`` is printed too: a write beside training shares the cores
with it, which no held time shows. The two runs must log the same losses: the tier changes nothing that is trained.
Times are wall clock: run it on an idle machine.
"""

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/

from _device_whole_checkpoints import SHAPE_CPU  # noqa: E402
from _gpu_worker import data  # noqa: E402

SEQ_LEN, BATCH = 64, 2


def _run(name: str, work: Path, every: int, steps: int, memory: bool) -> dict:
    import torch
    from accelerate.state import AcceleratorState, GradientState
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import trl_ext
    from trl_ext.assets import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = LlamaConfig(max_position_embeddings=2 * SEQ_LEN, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **SHAPE_CPU)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    args = trl_ext.SFTConfig(
        output_dir=str(work / name), max_steps=steps, save_strategy="steps", save_steps=steps if memory else every,
        memory_checkpoint_steps=every if memory else 0, per_device_train_batch_size=BATCH, max_length=SEQ_LEN,
        learning_rate=1e-4, logging_steps=1, report_to="none", seed=0, dataloader_num_workers=0)
    trainer = trl_ext.SFTTrainer(model=model, args=args, processing_class=tokenizer,
                                 train_dataset=data("sft", SEQ_LEN, rows=steps * BATCH))
    start = time.monotonic()
    trainer.train()
    total = time.monotonic() - start
    # each checkpoint's cost as trl_ext records it (the slowest rank's); the final save, the last of ``history``, apart
    costs = trainer.checkpoints.memory_history if memory else trainer.checkpoints.history[:-1]
    logged = [cost.metrics() for cost in costs]
    found = {
        "held_s": [e["checkpoint/held_s"] for e in logged],
        "write_s": [e["checkpoint/write_s"] for e in logged if "checkpoint/write_s" in e],
        "bytes": [e["checkpoint/bytes"] for e in logged if "checkpoint/bytes" in e],
        "losses": {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e},
        "train_s": total,
    }
    del trainer, model
    for cls in (AcceleratorState, GradientState):  # the next run builds its own accelerator
        cls._shared_state.clear()
    gc.collect()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=8, help="steps between checkpoints, either kind")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs, alternated")
    cli = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trl-ext-memory-held-"))
    os.environ["TRL_EXT_MEMORY_DIR"] = tempfile.mkdtemp(prefix="trl-ext-memory-held-", dir="/dev/shm")
    runs = {"foreground": [], "memory": []}
    try:
        for repeat in range(cli.repeats):
            order = ("foreground", "memory") if repeat % 2 == 0 else ("memory", "foreground")
            for name in order:
                runs[name].append(_run(f"{name}-{repeat}", work, cli.every, cli.steps, name == "memory"))
    finally:  # RAM and GBs: the checkpoints are not looked at after the run
        shutil.rmtree(os.environ["TRL_EXT_MEMORY_DIR"], ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    held = {name: [h for run in found for h in run["held_s"]] for name, found in runs.items()}
    writes = [w for run in runs["memory"] for w in run["write_s"]]
    sizes = [b for run in runs["memory"] for b in run["bytes"]]
    print(f"one process, 70M Llama on the CPU, a checkpoint every {cli.every} steps, {cli.steps} steps, "
          f"{cli.repeats} alternated pair(s)")
    for name, values in held.items():
        print(f"  {name:<10} held per checkpoint: median {statistics.median(values):.3f} s (min {min(values):.3f}, "
              f"max {max(values):.3f}; {len(values)} checkpoints)")
    if writes:
        print(f"  memory checkpoint written in the background in {statistics.median(writes):.2f} s (median), "
              f"{statistics.median(sizes) / 1e9:.2f} GB")
    for name, found in runs.items():
        print(f"  {name:<10} train() in all, the final save included: "
              f"{statistics.median(run['train_s'] for run in found):.1f} s (median)")
    ratio = statistics.median(held["memory"]) / statistics.median(held["foreground"])
    print(f"memory over foreground: {ratio:.3f}x (goal 0.03x)")
    same = all(run["losses"] == runs["foreground"][0]["losses"] for found in runs.values() for run in found)
    print(f"the same losses in every run: {same}")
    if not same:
        raise SystemExit("the runs' losses differ")


if __name__ == "__main__":
    main()
