"""One save under ZeRO-3 or FSDP2: trl_ext's save path (every rank writes), the same in the background
(``saving.save(..., into=...)``, what ``save_in_background`` does for checkpoints), the same with one writing
rank (what spreading the writes over every rank is measured against), or transformers' Trainer.save_model (plain
TRL).

Trains one step (so the engine exists, as in a real run), then saves while a thread samples rank 0's RSS every 2 ms.
Saves twice, as a run saves its checkpoints: the first save of a run also plans the layout and (background) allocates
the CPU copy, which later saves reuse. Prints ``BENCH {json}`` on rank 0, for the second save and the first: the time
training is blocked (the slowest rank's; for a foreground save, the whole save), the save's wall time until it is
committed on every rank; peak RSS growth over the level before the first save, the bytes of weights each rank wrote
per save (trl_ext), and each rank's CPU copy (background).
Before the baseline, free heap memory is handed back to the OS (``malloc_trim``): otherwise a save could reuse
memory the training step freed and look smaller than it is.
"""

import argparse
import ctypes
import gc
import json
import os
import threading
import time

import psutil
import torch
import trl
from datasets import Dataset

import trl_ext


class PeakRSS(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.process, self.peak, self.running = psutil.Process(), 0, True

    def run(self):
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.002)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["trl_ext", "trl_ext-background", "trl_ext-one-writer", "transformers"],
                        required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_shard_size", required=True)
    cli = parser.parse_args()

    trainer_cls = trl.SFTTrainer if cli.impl == "transformers" else trl_ext.SFTTrainer
    written = count_written_bytes()
    if cli.impl == "trl_ext-one-writer":  # every file to the first rank, at the user's shard size
        from trl_ext.saving import pipeline

        pipeline.split_for_writers = lambda ws, writers, max_shard_size: ws
        pipeline.assign_files = lambda plan, ranks: {filename: ranks[0] for filename in plan}
    args = trl_ext.SFTConfig(output_dir=cli.output_dir, max_steps=1, per_device_train_batch_size=1,
                             report_to="none", save_strategy="no", gradient_checkpointing=False,
                             max_length=32, max_shard_size=cli.max_shard_size)
    data = Dataset.from_list([{"messages": [{"role": "user", "content": "1+1"},
                                            {"role": "assistant", "content": "2"}]}] * 4)
    trainer = trainer_cls(model=cli.model, args=args, train_dataset=data)
    trainer.train()
    if cli.impl == "transformers":  # what Trainer.save_model passes to save_pretrained
        trainer.model.save_pretrained = _with_shard_size(trainer.model.save_pretrained, cli.max_shard_size)

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    torch.distributed.barrier()
    monitor = PeakRSS()
    base = monitor.process.memory_info().rss
    monitor.start()
    saves = Background() if cli.impl == "trl_ext-background" else None
    timings = [save_once(trainer, saves, os.path.join(cli.output_dir, f"saved-{i}"), cli.max_shard_size)
               for i in range(2)]
    monitor.running = False
    monitor.join()
    world = torch.distributed.get_world_size()
    per_rank, copies = [None] * world, [None] * world
    torch.distributed.all_gather_object(per_rank, written["bytes"] // 2)
    torch.distributed.all_gather_object(copies, saves.weight_bytes if saves is not None else 0)
    if trainer.accelerator.is_main_process:
        params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in trainer.model.parameters())
        (first_blocked, first_save), (blocked, save) = timings
        print("BENCH " + json.dumps({"save_s": save, "blocked_s": blocked, "first_save_s": first_save,
                                     "first_blocked_s": first_blocked, "peak_growth_mb": (monitor.peak - base) / 2**20,
                                     "params": params, "written_per_rank": per_rank, "copy_per_rank": copies}),
              flush=True)


def save_once(trainer, saves, directory: str, max_shard_size: str) -> tuple[float, float]:
    """One save: the slowest rank's blocking time (for a foreground save, all of it) and the time until it is
    committed on every rank."""
    torch.distributed.barrier()
    start = time.perf_counter()
    if saves is None:
        trainer.save_model(directory)
    else:  # the call trainer.save_model makes inside a background checkpoint (save_in_background)
        save = saves.begin(directory)
        trl_ext.saving.save(trainer.model, directory, processing_class=trainer.processing_class,
                            training_args=trainer.args, max_shard_size=max_shard_size, into=save)
        saves.release(save)
    blocked = time.perf_counter() - start  # this rank's next optimizer step could run here (the copies are made)
    if saves is not None:
        saves.wait()
    torch.distributed.barrier()
    elapsed = time.perf_counter() - start
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, blocked if saves is not None else elapsed)
    return max(everyone), elapsed


class Background:
    """The weights of a background checkpoint alone (``saving.checkpoints`` runs the same steps around Trainer's
    save): staged, copied (waited for, as the next optimizer step would), then written on the executor's thread."""

    def __init__(self):
        from trl_ext.saving.executor import Executor
        from trl_ext.saving.snapshot import Snapshot

        self.executor, self.snapshot, self.weight_bytes, self._save = Executor(), Snapshot(), 0, None

    def begin(self, directory: str):
        from trl_ext.saving.executor import BackgroundCheckpoint

        self.snapshot.begin()
        self._save = BackgroundCheckpoint(directory, self.executor, self.snapshot)
        return self._save

    def release(self, save) -> None:
        self.snapshot.start()
        self.snapshot.wait_for_copies()
        self.weight_bytes = save.weight_bytes
        self.executor.run(save)

    def wait(self) -> None:
        self.executor.join()
        if self._save.error is not None:
            raise self._save.error


def count_written_bytes() -> dict:
    """Bytes of weights this rank writes through trl_ext's shard writer."""
    from trl_ext.files import shards

    written, end = {"bytes": 0}, shards.ShardStreamWriter.end

    def counting_end(self):
        written["bytes"] += self._queue[self._position][1].nbytes
        end(self)

    shards.ShardStreamWriter.end = counting_end
    return written


def _with_shard_size(save_pretrained, max_shard_size):
    def save(*args, **kwargs):
        kwargs.setdefault("max_shard_size", max_shard_size)
        return save_pretrained(*args, **kwargs)

    return save


if __name__ == "__main__":
    main()
