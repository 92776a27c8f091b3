"""The memory tier under real launches: a recipe as users start it on one machine (``python recipes/dpo.py --config
accelerate_configs/zero3.yaml``, then FSDP2) with ``--memory_checkpoint_steps 2`` and a disk checkpoint every 10 steps.
One rank is SIGKILLed once memory checkpoint-12 is committed (during step 13); the launch restarts its ranks, which
resume from step 12 in memory, without reading the disk's checkpoint-10 (made unreadable after the kill), and the run
completes with its final save verified. The one-process cases are in tests/unit/test_memory_tier.py."""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.harness import run_command
from tests.machines import rank_process
from trl_ext.files.audit import audit
from trl_ext.saving import memory_tier

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TRAINING = ["--max_steps", "16", "--save_strategy", "steps", "--save_steps", "10", "--memory_checkpoint_steps", "2",
            "--logging_steps", "1", "--eval_strategy", "no", "--eval_on_start", "false"]


class KillOnceCommitted(threading.Thread):
    """SIGKILLs global rank 1 as soon as memory checkpoint ``step``'s manifest is in place, then damages the disk's
    newest checkpoint so that a resume that read it would fail."""

    def __init__(self, memory_dir: Path, out: Path, step: int, disk_step: int):
        super().__init__(daemon=True)
        self.memory_dir, self.out, self.step, self.disk_step = memory_dir, out, step, disk_step
        self.launcher: int | None = None  # set by watch()
        self.killed: str | None = None

    def watch(self, launcher) -> None:
        """Start watching, the launcher's process known (``run_command``'s ``on_start``)."""
        self.launcher = launcher.pid
        self.start()

    def run(self):
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and self.killed is None:
            if any(self.memory_dir.glob(f"*/.checkpoint-{self.step}.manifest.json")):
                victim = rank_process(self.launcher, 1)
                if victim is not None:
                    os.kill(victim.pid, signal.SIGKILL)
                    self.killed = f"rank 1 (pid {victim.pid})"
                    for path in (self.out / f"checkpoint-{self.disk_step}").rglob("*"):
                        if path.is_file():
                            path.write_bytes(b"")  # a resume that read it would fail
            time.sleep(0.02)


@pytest.mark.parametrize("config", ["zero3", "fsdp2"])
def test_a_rank_killed_on_one_machine_restarts_and_resumes_from_memory(config, tmp_path):
    out, memory_dir = tmp_path / "dpo", tmp_path / "shm"
    cmd = [sys.executable, "recipes/dpo.py", "--config", f"accelerate_configs/{config}.yaml", "--output_dir", str(out),
           *TRAINING]
    killer = KillOnceCommitted(memory_dir, out, step=12, disk_step=10)
    result = run_command(cmd, 780, {"HF_HOME": str(tmp_path / "hf"), "TRL_EXT_MEMORY_DIR": str(memory_dir)},
                         on_start=killer.watch)
    (tmp_path / "output.log").write_text(result.output)
    assert killer.killed, result.output[-4000:]
    assert not result.timed_out and result.returncode == 0, result.output[-6000:]
    assert "a lost rank restarts them (at most 3 times, TRL_EXT_MAX_FAILURES), resuming from memory" in result.output
    root = next(memory_dir.iterdir(), None) if memory_dir.is_dir() else None
    resumed = [line for line in result.output.splitlines() if "resuming from step" in line]
    assert len(resumed) == 1 and "restart 1: resuming from step 12 in memory (" in resumed[0] and \
        "the newest on disk is checkpoint-10" in resumed[0], resumed or result.output[-4000:]
    assert f"saved and verified: {out}" in result.output
    assert audit(str(out), base=None).ok
    assert root is None, "the completed run kept its memory checkpoints"
    assert memory_tier.TOKEN in {p.name for p in out.iterdir()}
