"""The harness itself: a hung launch is killed within its timeout and leaves no process behind."""

import os
import time

import pytest

from tests.harness import accelerate_launch, write_accelerate_config

pytestmark = pytest.mark.slow


def test_hung_launch_is_killed_with_all_ranks(tmp_path):
    script = tmp_path / "hang.py"
    pids = tmp_path / "pids"
    pids.mkdir()
    script.write_text(
        "import os, pathlib, time\n"
        f"pathlib.Path({str(pids)!r}, str(os.getpid())).touch()\n"
        "time.sleep(600)\n"
    )
    config = write_accelerate_config(tmp_path, "ddp")
    start = time.monotonic()
    result = accelerate_launch(script, [], config, timeout=20)
    assert result.timed_out and time.monotonic() - start < 60
    rank_pids = [int(p.name) for p in pids.iterdir()]
    assert len(rank_pids) == 2
    time.sleep(0.5)
    for pid in rank_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
