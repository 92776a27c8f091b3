"""How a launched process ends (process/clean_exit.py): ``end_together`` on gloo leaves through ``exit_now``, which
takes the interpreter's exit steps in its order, then ``os._exit``. Each test runs a real interpreter in a gloo group
of its own (torch only: about 3 s)."""

import subprocess
import sys

import pytest

_SCRIPT = """
import atexit, concurrent.futures, sys, threading
import torch.distributed as dist
from trl_ext.process import before_exit, end_together

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
pool = concurrent.futures.ThreadPoolExecutor(2)  # kept, idle: its workers are non-daemon threads
pool.submit(print, "pool ran", flush=True).result()
atexit.register(lambda: print("atexit ran, group " + ("alive" if dist.is_initialized() else "destroyed"), flush=True))
before_exit(lambda: print("before_exit ran, group " + ("alive" if dist.is_initialized() else "destroyed"), flush=True))
worker = threading.Thread(target=lambda: (threading.Event().wait(1.0), print("worker ended", flush=True)))
worker.start()  # a non-daemon thread of the script's own: the exit waits for it, as the interpreter's does
end_together()
print("not reached", flush=True)
"""


def test_end_together_on_gloo_runs_the_exit_steps_in_the_interpreters_order_and_ends(tmp_path):
    """A colocated vLLM leaves idle ThreadPoolExecutor pools, whose workers end only once concurrent.futures' exit hook
    tells them to: joined before that hook, they never ended, and a finished GRPO run hung at its last line."""
    script = tmp_path / "script.py"
    script.write_text(_SCRIPT)
    try:
        done = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the process did not end: {hung.stdout!r} {hung.stderr!r}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["pool ran", "before_exit ran, group alive", "worker ended",
                                        "atexit ran, group destroyed"], done.stdout + done.stderr
