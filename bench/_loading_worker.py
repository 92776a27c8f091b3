"""Load a model into a 2-process FSDP2 run (SFT, or DPO with its reference model) and take one step; print each
rank's peak RSS growth in each phase and the bytes of weights it read.

Peak RSS growth over the RSS just before the trainer is built, per phase: ``load`` (building the trainer: TRL loads
the model, and prepares DPO's reference model), ``shard`` (accelerate shards the model and broadcasts rank 0's
weights, up to ``on_train_begin``) and ``step`` (the first step, with its Adam states and gradients). Prints
``BENCH {json}`` on every rank.
"""

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.harness, tests.probes

import psutil
import torch
from datasets import Dataset
from transformers import TrainerCallback

import trl_ext
from tests.probes import weight_reads as _weight_reads


class PhasePeaks(threading.Thread, TrainerCallback):
    """Samples RSS every 2 ms and keeps the peak of the phase under way; Trainer's ``on_train_begin`` ends ``shard``."""

    def __init__(self):
        super().__init__(daemon=True)
        self.process, self.phase, self.peaks, self.running = psutil.Process(), "load", {}, True

    def run(self):
        while self.running:
            phase, rss = self.phase, self.process.memory_info().rss
            self.peaks[phase] = max(self.peaks.get(phase, 0), rss)
            time.sleep(0.002)

    def on_train_begin(self, args, state, control, **kwargs):
        self.phase = "step"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--trainer", choices=["sft", "dpo"], default="sft")
    cli = parser.parse_args()

    _weight_reads.install()
    common = dict(output_dir=cli.output_dir, max_steps=1, per_device_train_batch_size=1, report_to="none",
                  save_strategy="no", gradient_checkpointing=False, max_length=32)
    if cli.trainer == "sft":
        trainer_cls, args = trl_ext.SFTTrainer, trl_ext.SFTConfig(**common)
        row = {"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}
    else:  # full fine-tuning: TRL builds a second model, the reference, from the same files
        trainer_cls, args = trl_ext.DPOTrainer, trl_ext.DPOConfig(**common)
        row = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
    data = Dataset.from_list([row] * 4)

    monitor = PhasePeaks()
    base = monitor.process.memory_info().rss
    monitor.start()
    trainer = trainer_cls(model=cli.model, args=args, train_dataset=data, callbacks=[monitor])
    monitor.phase = "shard"
    trainer.train()
    monitor.running = False
    monitor.join()
    local = sum(p.to_local().numel() * p.element_size() for p in trainer.model.parameters())
    print("BENCH " + json.dumps({"rank": int(os.environ["RANK"]), "local_params_mb": local / 2**20,
                                 "growth_mb": {k: (v - base) / 2**20 for k, v in monitor.peaks.items()},
                                 "read_mb": sum(_weight_reads.READS.values()) / 2**20,
                                 "efficient": os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING")}), flush=True)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
