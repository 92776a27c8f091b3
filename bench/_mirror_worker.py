"""One training run for ``bench/mirror.py``: a full fine-tune (AdamW, one process) that saves ``checkpoint-N`` every
``--save_steps`` steps, with or without a checkpoint mirror (the S3 server's address and keys come from the standard
AWS variables). Prints ``BENCH {json}``: each step's time, the time from this process's start (``--started``, the
launcher's clock) to the end of its first step, the download's time when it resumed from the mirror, and the time
until every upload was done after training."""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import trl_ext  # noqa: E402
from trl_ext.mirror import downloader  # noqa: E402


class Steps(TrainerCallback):
    def __init__(self):
        self.began, self.times, self.first_end = None, [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.began)
        self.first_end = self.first_end or time.time()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--mirror", default=None)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--save_steps", type=int, default=4)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--started", type=float, default=time.time())
    cli = parser.parse_args()
    downloads = []
    newest = downloader.newest

    def timed_newest(*args, **kwargs):
        start = time.perf_counter()
        try:
            return newest(*args, **kwargs)
        finally:
            downloads.append(time.perf_counter() - start)

    downloader.newest = timed_newest
    args = trl_ext.SFTConfig(output_dir=cli.output_dir, max_steps=cli.steps, save_steps=cli.save_steps,
                             per_device_train_batch_size=1, report_to="none", gradient_checkpointing=False,
                             max_length=32, optim="adamw_torch", checkpoint_mirror=cli.mirror, logging_steps=100)
    data = Dataset.from_list([{"messages": [{"role": "user", "content": "1+1"},
                                            {"role": "assistant", "content": "2"}]}] * 64)
    trainer = trl_ext.SFTTrainer(model=cli.model, args=args, train_dataset=data)
    steps = Steps()
    trainer.add_callback(steps)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=True if cli.resume else None)
    trained = time.perf_counter() - start
    waited = time.perf_counter()
    if trainer.mirror is not None:
        trainer.mirror.wait()
    print("BENCH " + json.dumps({"steps": steps.times, "train_s": trained,
                                 "upload_wait_s": time.perf_counter() - waited,
                                 "start_to_first_step_s": steps.first_end - cli.started,
                                 "download_s": sum(downloads)}), flush=True)


if __name__ == "__main__":
    main()
