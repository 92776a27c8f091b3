"""Training runs shared by several test modules: each 2-process launch costs tens of seconds on CPU, so a run that
can answer several tests' questions is made once per session and read by all of them (read only: no test writes
into a shared run's directory, except for new paths of its own)."""

import json
import os
from pathlib import Path

import pytest

from tests.harness import (
    MANY_TIMEOUT,
    ONE_RUN_PER_LAUNCH,
    SCRIPTS,
    accelerate_launch,
    hang_bound,
    write_accelerate_config,
)

# The uninterrupted runs of tests/distributed/test_reliability.py: 4 steps, a checkpoint every 2, TRL's default
# gradient checkpointing. They also serve test_zero_training (trains under ZeRO-3, partitions) and test_checkpointing
# (non-reentrant by default). All five are made in one launch.
ZERO3_TRAIN = ["--max_steps", "4", "--save_steps", "2"]
ZERO3_CASES = [("sft", False), ("sft", True), ("reward", True), ("dpo", True), ("dpo", False)]

# save_roundtrip.py runs that serve two modules each: test_saving and test_merge (SFT, LoRA), test_reward_head and
# test_merge (a reward model with the report-F2 PEFT config: LoRA on all linear layers, no task_type).
SFT_LORA_ROUNDTRIP = ["--lora", "--save_steps", "2", "--iter_merged"]
REWARD_ALL_LINEAR_ROUNDTRIP = ["--lora_all_linear", "--save_steps", "2", "--iter_merged"]
# The save_roundtrip.py runs under ZeRO-3 with the default DeepSpeed config, made in one launch: (trainer, args).
ROUNDTRIP_ZERO3 = [("sft", SFT_LORA_ROUNDTRIP), ("dpo", ["--lora"]),
                   ("sft", ["--save_steps", "2", "--max_shard_size", "100KB"]),
                   ("reward", REWARD_ALL_LINEAR_ROUNDTRIP), ("reward", [])]


def train_args(trainer: str, lora: bool, *extra: str) -> list[str]:
    return ["--trainer", trainer, *(["--lora"] if lora else []), *extra]


# Each engine's shared launch (test_trajectory's): every trainer, full and LoRA, 4 steps of 4 rows.
ENGINE_CASES = [("sft", False), ("sft", True), ("reward", False), ("reward", True), ("dpo", False), ("dpo", True)]


def engine_args(backend: str, trainer: str, lora: bool, batch: int = 2, accumulation: int = 1) -> list[str]:
    """One case of an engine's shared launch. ZeRO-3's is the suite's shared run; ZeRO-2's and FSDP2's full SFT saves
    checkpoints 2 and 4 too, the foreground reference of tests/distributed/test_background_saves.py."""
    if (backend, batch, accumulation) == ("zero3", 2, 1):
        return train_args(trainer, lora, *ZERO3_TRAIN)  # the shared runs (their checkpoints change nothing here)
    checkpoints = ["--save_steps", "2"] if (trainer, lora) == ("sft", False) and backend in ("zero2", "fsdp2") else []
    return train_args(trainer, lora, "--max_steps", "4", "--batch", str(batch), "--grad_accum", str(accumulation),
                      *checkpoints)


def _with_output_dir(args: list[str], default: Path) -> tuple[list[str], Path]:
    """``args`` with an ``--output_dir`` (``default`` unless they name one), and that directory."""
    if "--output_dir" in args:
        return list(args), Path(args[args.index("--output_dir") + 1])
    return [*args, "--output_dir", str(default)], default


class SharedRuns:
    """Launch a script once per distinct argument list in this session; later calls get the first result."""

    def __init__(self, root: Path):
        self.root, self.done, self.started = root, {}, 0
        self.outputs: dict[Path, str] = {}  # a run's output directory -> its launch's combined output

    def get(self, script: str, backend: str, args: list[str], timeout: float = 300, num_processes: int = 2,
            **zero) -> Path:
        """The output directory of ``script ARGS --output_dir OUT`` under ``backend``, launched on first use (``ARGS``
        may name their own ``--output_dir``: a test's own run, made in a shared launch)."""
        key = (script, backend, tuple(args), tuple(sorted(zero.items())), num_processes)
        timeout = hang_bound(timeout)  # in the one-run-per-launch leg, a run ``many`` would have made
        if key not in self.done:
            directory = self._directory()
            args, out = _with_output_dir(args, directory / "out")
            self.outputs[out] = self._launch(script, args, directory, backend, timeout, num_processes, **zero)
            self.done[key] = out
        return self.done[key]

    def many(self, script: str, backend: str, runs: list[list[str]], timeout: float = MANY_TIMEOUT,
             num_processes: int = 2) -> None:
        """Make those of ``runs`` (argument lists of ``script``) not made yet in one launch (``run_many.py``);
        ``get`` then finds them."""
        todo = [args for args in runs if (script, backend, tuple(args), (), num_processes) not in self.done]
        if not todo or os.environ.get(ONE_RUN_PER_LAUNCH):  # then ``get`` launches each run when a test asks
            return
        directory = self._directory()
        argvs, outs = zip(*(_with_output_dir(args, directory / f"out{i}") for i, args in enumerate(todo)))
        output = self._launch("run_many.py", [script, json.dumps(argvs)], directory, backend, timeout, num_processes)
        for args, out in zip(todo, outs):
            self.done[script, backend, tuple(args), (), num_processes] = out
            self.outputs[out] = output

    def _directory(self) -> Path:
        self.started += 1  # a fresh directory even after a failed launch
        return self.root / f"run{self.started}"

    def _launch(self, script: str, args: list[str], directory: Path, backend: str, timeout: float,
                num_processes: int = 2, **zero) -> str:
        config = write_accelerate_config(directory / "configs", backend, num_processes, **zero)
        result = accelerate_launch(SCRIPTS / script, args, config, timeout)
        assert not result.timed_out, f"launch timed out after {timeout}s:\n{result.output[-4000:]}"
        assert result.returncode == 0, f"launch failed ({result.returncode}):\n{result.output[-6000:]}"
        return result.output


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> SharedRuns:
    return SharedRuns(tmp_path_factory.mktemp("shared_runs"))


@pytest.fixture(scope="session")
def zero3_run(shared_runs):
    """``zero3_run(trainer, lora)``: the output directory and rank 0's report of ``train.py`` under ZeRO-3, with the
    launch's output under ``"output"`` (one launch makes every case)."""

    def run(trainer: str, lora: bool) -> tuple[Path, dict]:
        shared_runs.many("train.py", "zero3", [train_args(*case, *ZERO3_TRAIN) for case in ZERO3_CASES])
        out = shared_runs.get("train.py", "zero3", train_args(trainer, lora, *ZERO3_TRAIN))
        return out, {**json.loads((out / "report_rank0.json").read_text()), "output": shared_runs.outputs[out]}

    return run


@pytest.fixture(scope="session")
def roundtrip(shared_runs):
    """``roundtrip(backend, trainer, *args, **zero)``: the output directory of ``save_roundtrip.py``."""

    def run(backend: str, trainer: str, *args: str, **zero) -> Path:
        if backend == "zero3" and not zero:
            shared_runs.many("save_roundtrip.py", "zero3", [["--trainer", t, *a] for t, a in ROUNDTRIP_ZERO3])
        return shared_runs.get("save_roundtrip.py", backend, ["--trainer", trainer, *args], **zero)

    return run

