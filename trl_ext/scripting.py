"""Small helpers the recipes share: run directories, existing-output protection, and the closing message."""

import os
import sys
import time
from pathlib import Path

TRANSFORMERS_DEFAULT_OUTPUT_DIR = "trainer_output"  # what TrainingArguments picks when none is given


def prepare_output_dir(training_args, recipe: str) -> str:
    """Give each run its own directory unless the user chose one, and never train over another run's output.

    Returns the output directory; exits with a message (code 2) if a chosen directory already holds files and the
    run is not a resume.
    """
    if training_args.output_dir in (None, TRANSFORMERS_DEFAULT_OUTPUT_DIR):
        training_args.output_dir = _same_on_all_ranks(
            os.path.join("outputs", f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        )
    out = Path(training_args.output_dir)
    if out.is_dir() and any(out.iterdir()) and not training_args.resume_from_checkpoint:
        sys.exit(
            f"error: output_dir '{out}' already holds files from another run; nothing was changed. "
            "Choose a new --output_dir, or pass --resume_from_checkpoint to continue that run."
        )
    return str(out)


def _same_on_all_ranks(value: str) -> str:
    """Rank 0's value everywhere (ranks start at slightly different times)."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    if PartialState().num_processes == 1:
        return value
    return broadcast_object_list([value], from_process=0)[0]


def announce_done(trainer, what: str, next_command: str) -> None:
    if trainer.accelerator.is_main_process:
        print(f"\n[trl_ext] {what} saved to {trainer.args.output_dir}\n[trl_ext] next: {next_command}", flush=True)
