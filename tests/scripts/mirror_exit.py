"""A user's own training script with a checkpoint mirror (issue 62's): it never waits for the mirror, and leaves as a
script does, through the interpreter's own exit (not ``launched.finish``): the exit paths are what is tested.

Run with plain ``python`` (1 process) or under ``accelerate launch`` (ZeRO-3, 2 processes). ``--mode``:

- ``save_model``: ``train()``, ``save_model()``, return (the issue's script);
- ``train``: return right after ``train()``, its last checkpoints' uploads still queued;
- ``raise``: ``train()``, ``save_model()``, then an exception on every rank.

Its last line, on every rank, is ``SCRIPT END rank R at <time.time()>``; ``--marker`` is written by rank 0 just before
it (a test's proxy stalls the store once it exists). Each rank writes its process id to ``<pids>/rank<R>.pid`` before it
trains (a test signals every rank). ``--wait_for FILE --wait_at_step N``: every rank waits for ``FILE`` before step N (a
test sends its signals during an upload, then writes the file: the signal comes while training runs, whatever the
speed of the machine). ``--config_json``: more SFTConfig fields.
"""

import argparse
import json
import os
import time
from pathlib import Path

from transformers import TrainerCallback

from trl_ext import SFTConfig, SFTTrainer
from trl_ext.assets import load_dataset_by_name, resolve_model
from trl_ext.process import env_rank


class WaitForFile(TrainerCallback):
    """Every rank waits for ``path`` before optimizer step ``step``."""

    def __init__(self, step: int, path: Path, timeout: float = 300):
        self.step, self.path, self.timeout = step, path, timeout

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            deadline = time.monotonic() + self.timeout
            while not self.path.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.path} did not appear within {self.timeout} s")
                time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["save_model", "train", "raise"], required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--mirror", required=True)
    parser.add_argument("--marker", type=Path, default=None)
    parser.add_argument("--pids", type=Path, default=None)
    parser.add_argument("--wait_for", type=Path, default=None)
    parser.add_argument("--wait_at_step", type=int, default=3)
    parser.add_argument("--config_json", default="{}")
    cli = parser.parse_args()
    rank = env_rank()
    if cli.pids is not None:
        cli.pids.mkdir(parents=True, exist_ok=True)
        partial = cli.pids / f".rank{rank}.pid"
        partial.write_text(str(os.getpid()))
        partial.rename(cli.pids / f"rank{rank}.pid")  # whole once it is there

    ds = load_dataset_by_name("trl-ext/arithmetic-sft")["train"].select(range(32))
    args = SFTConfig(output_dir=cli.output_dir, max_steps=4, save_strategy="steps", save_steps=2,
                     per_device_train_batch_size=4, report_to=[], checkpoint_mirror=cli.mirror, bf16=False,
                     **json.loads(cli.config_json))
    trainer = SFTTrainer(model=resolve_model("trl-ext/tiny-llama"), args=args, train_dataset=ds)
    if cli.wait_for is not None:
        trainer.add_callback(WaitForFile(cli.wait_at_step, cli.wait_for))
    trainer.train()
    if cli.mode != "train":
        trainer.save_model()
    if cli.marker is not None and rank == 0:
        cli.marker.write_text("returning")
    print(f"SCRIPT END rank {rank} at {time.time():.3f}", flush=True)
    if cli.mode == "raise":
        raise RuntimeError("the user's script failed after training")


if __name__ == "__main__":
    main()
