"""A full fine-tune (AdamW) that saves a whole ``checkpoint-N`` every ``--save_steps`` steps, in the foreground or
with ``save_in_background`` (or none, ``--save_steps 0``), reporting what each checkpoint cost as the trainer logs it.

Per checkpoint, the slowest rank's: ``checkpoint/held_save_s`` (inside ``_save_checkpoint``), ``held_copy_wait_s``
(the wait for its copies before the next optimizer step), ``held_previous_s`` (the wait for the previous checkpoint),
their sum ``held_s``, and ``write_s`` (its files written, synced, checked and committed): ``Checkpoints.history``, what
``checkpoint/*`` logs. Also: the one-time ``reserve`` at the end of the first step, each step's time, the training's
wall time, rank 0's peak RSS over its level when training started, and the CPU copies rank 0 holds. Prints
``BENCH {json}`` on rank 0.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.harness, tests.probes

import torch
from _save_worker import PeakRSS  # bench/ is this script's directory
from datasets import Dataset
from transformers import TrainerCallback

import trl_ext


class Steps(TrainerCallback):
    """Each optimizer step's wall time (from its begin to its end)."""

    def __init__(self):
        self.times, self._start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--background", action="store_true")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--save_steps", type=int, default=2, help="0: no checkpoints")
    cli = parser.parse_args()

    args = trl_ext.SFTConfig(output_dir=cli.output_dir, max_steps=cli.steps, save_steps=cli.save_steps or 500,
                             save_strategy="steps" if cli.save_steps else "no", per_device_train_batch_size=1,
                             report_to="none", gradient_checkpointing=False, max_length=32, optim="adamw_torch",
                             save_in_background=cli.background, logging_steps=1)
    data = Dataset.from_list([{"messages": [{"role": "user", "content": "1+1"},
                                            {"role": "assistant", "content": "2"}]}] * 64)
    trainer = trl_ext.SFTTrainer(model=cli.model, args=args, train_dataset=data)
    checkpoints, reserve = trainer.checkpoints, []
    original_reserve = checkpoints.reserve

    def timed_reserve():
        start = time.perf_counter()
        original_reserve()
        reserve.append(time.perf_counter() - start)

    checkpoints.reserve = timed_reserve
    steps = Steps()
    trainer.add_callback(steps)
    monitor = PeakRSS()
    base = monitor.process.memory_info().rss
    monitor.start()
    torch.distributed.barrier()
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    monitor.running = False
    monitor.join()
    copies = checkpoints.snapshot.allocated if checkpoints.snapshot is not None else 0
    world = torch.distributed.get_world_size()
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, {"reserve": max(reserve, default=0.0), "total": total,
                                                   "peak_mb": (monitor.peak - base) / 2**20,
                                                   "copies_mb": copies / 2**20})
    if trainer.accelerator.is_main_process:
        params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in trainer.model.parameters())
        costs = [cost.metrics() for cost in checkpoints.history]  # the slowest rank's
        print("BENCH " + json.dumps({"checkpoints": costs,
                                     "reserve_s": max(r["reserve"] for r in everyone), "steps": steps.times,
                                     "total_s": max(r["total"] for r in everyone),
                                     "peak_mb": everyone[0]["peak_mb"], "copies_mb": everyone[0]["copies_mb"],
                                     "params": params}), flush=True)
    # as a recipe ends: the ranks leave together, without gloo's teardown, which can abort a rank at exit under FSDP2
    # (pytorch#190489)
    trl_ext.process.end_together()


if __name__ == "__main__":
    main()
