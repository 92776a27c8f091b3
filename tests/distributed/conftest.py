"""Training runs shared by several test modules: each 2-process launch costs tens of seconds on CPU, so a run that
can answer several tests' questions is made once per session and read by all of them (read only: no test writes
into a shared run's directory, except for new paths of its own)."""

import json
from pathlib import Path

import pytest

from tests.harness import SCRIPTS, launch, write_accelerate_config

# The uninterrupted runs of tests/distributed/test_reliability.py: 4 steps, a checkpoint every 2, TRL's default
# gradient checkpointing. They also serve test_zero_training (trains under ZeRO-3, partitions) and test_checkpointing
# (non-reentrant by default).
ZERO3_TRAIN = ["--max_steps", "4", "--save_steps", "2"]


class SharedRuns:
    """Launch a script once per distinct argument list in this session; later calls get the first result."""

    def __init__(self, root: Path):
        self.root, self.done, self.started = root, {}, 0

    def get(self, script: str, backend: str, args: list[str], timeout: float = 300, **zero) -> Path:
        key = (script, backend, tuple(args), tuple(sorted(zero.items())))
        if key not in self.done:
            directory = self.root / f"run{self.started}"  # a fresh directory even after a failed launch
            self.started += 1
            config = write_accelerate_config(directory / "configs", backend, **zero)
            out = directory / "out"
            result = launch(SCRIPTS / script, [*args, "--output_dir", str(out)], config, timeout)
            assert not result.timed_out, f"launch timed out after {timeout}s:\n{result.output[-4000:]}"
            assert result.returncode == 0, f"launch failed ({result.returncode}):\n{result.output[-6000:]}"
            self.done[key] = out
        return self.done[key]


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> SharedRuns:
    return SharedRuns(tmp_path_factory.mktemp("shared_runs"))


@pytest.fixture(scope="session")
def zero3_run(shared_runs):
    """``zero3_run(trainer, lora)``: the output directory and rank 0's report of ``train.py`` under ZeRO-3."""

    def run(trainer: str, lora: bool) -> tuple[Path, dict]:
        args = ["--trainer", trainer, *ZERO3_TRAIN, *(["--lora"] if lora else [])]
        out = shared_runs.get("train.py", "zero3", args)
        return out, json.loads((out / "report_rank0.json").read_text())

    return run


@pytest.fixture(scope="session")
def roundtrip(shared_runs):
    """``roundtrip(backend, trainer, *args, **zero)``: the output directory of ``save_roundtrip.py``."""

    def run(backend: str, trainer: str, *args: str, **zero) -> Path:
        return shared_runs.get("save_roundtrip.py", backend, ["--trainer", trainer, *args], **zero)

    return run


# save_roundtrip.py runs that serve two modules each: test_saving and test_merge (SFT, LoRA), test_reward_head and
# test_merge (a reward model with the report-F2 PEFT config: LoRA on all linear layers, no task_type).
SFT_LORA_ROUNDTRIP = ["--lora", "--save_steps", "2", "--iter_merged"]
REWARD_ALL_LINEAR_ROUNDTRIP = ["--lora_all_linear", "--save_steps", "2", "--iter_merged"]
