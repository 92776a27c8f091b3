"""A full fine-tune (AdamW) that saves a whole ``checkpoint-N`` every ``--save_steps`` steps, in the foreground or
with ``save_in_background``, timing how long each checkpoint holds the training loop.

Blocked time per checkpoint: the time ``Trainer._save_checkpoint`` takes (a wait for the previous background save
included) plus the following step boundaries' checks (``BackgroundSaves.poll``: an all-reduce while the save is in
flight, then the agreement on its outcome), the slowest rank's. The wait for the last one when training ends is in the
total time only (nothing trains then). Also: the one-time ``reserve`` at the end of the first step (the CPU
copies planned and allocated), the training's wall time, rank 0's peak RSS over its level when training started,
and the CPU copies rank 0 holds. Prints ``BENCH {json}`` on rank 0.
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

import trl_ext
from trl_ext.saving import background as background_module
from trl_ext.saving import checkpoints as checkpoints_module


def timed(owner, name: str, record: list, kind: str | None = None):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            record.append((kind, seconds) if kind else seconds)

    setattr(owner, name, wrapper)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--background", action="store_true")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--save_steps", type=int, default=2)
    cli = parser.parse_args()

    args = trl_ext.SFTConfig(output_dir=cli.output_dir, max_steps=cli.steps, save_steps=cli.save_steps,
                             per_device_train_batch_size=1, report_to="none", gradient_checkpointing=False,
                             max_length=32, optim="adamw_torch", save_in_background=cli.background)
    data = Dataset.from_list([{"messages": [{"role": "user", "content": "1+1"},
                                            {"role": "assistant", "content": "2"}]}] * 64)
    trainer = trl_ext.SFTTrainer(model=cli.model, args=args, train_dataset=data)
    events, reserve, steps = [], [], []  # events: ("save" | "poll" | "wait", seconds)
    timed(trainer, "_save_checkpoint", events, "save")
    timed(background_module.BackgroundSaves, "poll", events, "poll")  # each step boundary
    timed(checkpoints_module.Checkpoints, "reserve", reserve)
    step_start = [None]

    from transformers import TrainerCallback

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            step_start[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            steps.append(time.perf_counter() - step_start[0])

    trainer.add_callback(Steps())
    monitor = PeakRSS()
    base = monitor.process.memory_info().rss
    monitor.start()
    torch.distributed.barrier()
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    monitor.running = False
    monitor.join()
    # Each checkpoint's blocking: its _save_checkpoint, plus the boundary polls until the next one
    blocked = []
    for kind, seconds in events:
        if kind == "save":
            blocked.append(seconds)
        elif blocked:
            blocked[-1] += seconds
    saves = trainer._checkpoints.background  # the CPU copies this rank holds for the rest of the run
    copies = 0 if saves is None else saves.snapshot.allocated + sum(
        b.numel() * b.element_size() for b in saves._buffers.values())
    world = torch.distributed.get_world_size()
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, {"blocked": blocked, "reserve": sum(reserve), "steps": steps,
                                                   "total": total, "peak_mb": (monitor.peak - base) / 2**20,
                                                   "copies_mb": copies / 2**20})
    if trainer.accelerator.is_main_process:
        slowest = [max(r["blocked"][i] for r in everyone) for i in range(len(blocked))]
        params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in trainer.model.parameters())
        print("BENCH " + json.dumps({"blocked": slowest, "reserve_s": max(r["reserve"] for r in everyone),
                                     "step_s": sorted(everyone[0]["steps"])[len(everyone[0]["steps"]) // 2],
                                     "total_s": max(r["total"] for r in everyone),
                                     "peak_mb": everyone[0]["peak_mb"], "copies_mb": everyone[0]["copies_mb"],
                                     "params": params}), flush=True)


if __name__ == "__main__":
    main()
