"""The test suite's launch helpers: ``bench/_harness.py`` (accelerate launch with 2 CPU processes, each in its own
killable process group), plus the scripts under ``tests/scripts`` and ``run_training``."""

import json
from pathlib import Path

from bench._harness import (
    REPO,
    Launch,
    accelerate_launch,
    deepspeed_config,
    kill_tree,
    run_command,
    write_accelerate_config,
)

__all__ = ["REPO", "SCRIPTS", "Launch", "accelerate_launch", "deepspeed_config", "kill_tree", "run_command",
           "run_training", "write_accelerate_config"]

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def run_training(tmp_path: Path, backend: str, trainer: str, *extra: str, timeout: float = 300) -> dict:
    """Train ``trainer`` on 2 processes under ``backend`` and return rank 0's report (asserting success), with the
    launch's combined output under ``"output"``."""
    config = write_accelerate_config(tmp_path / "configs", backend)
    out = tmp_path / "out"
    result = accelerate_launch(SCRIPTS / "train.py", ["--trainer", trainer, "--output_dir", str(out), *extra], config,
                               timeout)
    assert not result.timed_out, f"launch timed out after {timeout}s:\n{result.output[-4000:]}"
    assert result.returncode == 0, f"launch failed ({result.returncode}):\n{result.output[-6000:]}"
    return {**json.loads((out / "report_rank0.json").read_text()), "output": result.output}
