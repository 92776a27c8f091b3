"""Load a model into a 2-process FSDP2 SFT run and take one step; print each rank's peak RSS growth meanwhile.

The growth is measured from just before the trainer is built (model loading by TRL, sharding and the rank-0
broadcast by accelerate at the first step) to the end of that step. Prints ``BENCH {json}`` on every rank.
"""

import argparse
import json
import os

import torch
from _save_worker import PeakRSS  # bench/_save_worker.py, beside this script
from datasets import Dataset

import trl_ext


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--output_dir", required=True)
    cli = parser.parse_args()

    monitor = PeakRSS()
    base = monitor.process.memory_info().rss
    monitor.start()
    args = trl_ext.SFTConfig(output_dir=cli.output_dir, max_steps=1, per_device_train_batch_size=1, report_to="none",
                             save_strategy="no", gradient_checkpointing=False, max_length=32)
    data = Dataset.from_list([{"messages": [{"role": "user", "content": "1+1"},
                                            {"role": "assistant", "content": "2"}]}] * 4)
    trainer = trl_ext.SFTTrainer(model=cli.model, args=args, train_dataset=data)
    trainer.train()
    monitor.running = False
    monitor.join()
    local = sum(p.to_local().numel() * p.element_size() for p in trainer.model.parameters())
    print("BENCH " + json.dumps({"rank": int(os.environ["RANK"]), "peak_growth_mb": (monitor.peak - base) / 2**20,
                                 "local_params_mb": local / 2**20,
                                 "efficient": os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING")}), flush=True)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
