"""DeepSpeed's CPU ops, which DeepSpeed processes load through torch's JIT builder, in a directory of this test
environment's own, each built once, in one process, before any launch needs it: the communication op
(``deepspeed_shm_comm``, every DeepSpeed process on a CPU) and CPU Adam (``cpu_adam``, the optimizer-offload configs;
its build takes 200 s of CPU, more than a launch's whole timeout on a loaded 2-core machine).

Why: torch's builder holds a lock file in the build directory while it builds or checks the build, and waits for ever
while another holds it. A process killed in that window (a test kills ranks, nodes and jobs) leaves the lock, and
every later DeepSpeed launch there hangs. The user-wide default (``~/.cache/torch_extensions``) is also shared with
other environments, whose builds (with their own paths) make each launch rebuild it.
"""

import functools
import os
import subprocess
import sys
from pathlib import Path

DIRECTORY = Path(sys.prefix) / "torch_extensions"
COMM, CPU_ADAM = "deepspeed_shm_comm", "cpu_adam"  # each op's directory name in DIRECTORY
_LOAD = {COMM: "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load(verbose=False)",
         CPU_ADAM: "from deepspeed.ops.op_builder import CPUAdamBuilder as B; B().load(verbose=False)"}


def use_own_directory() -> None:
    """Points this process (and the launches it makes) at ``DIRECTORY`` and removes the locks a killed build left
    there: called once when a test session starts, before any of its launches."""
    os.environ["TORCH_EXTENSIONS_DIR"] = str(DIRECTORY)
    _remove_stale_locks("*")


def _remove_stale_locks(op: str) -> None:
    """Removes the op's build locks that no process holds open (a live builder keeps its lock's descriptor open, and
    another test session, the Slurm leg's, may be building now)."""
    locks = list(DIRECTORY.glob(f"{op}/lock")) + list(DIRECTORY.glob(f"*/{op}/lock"))
    held = _open_files() if locks else set()
    for lock in locks:
        if str(lock.resolve()) not in held:
            lock.unlink(missing_ok=True)


def _open_files() -> set[str]:
    """The paths every process of this machine holds open (Linux's /proc; empty elsewhere)."""
    paths = set()
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            paths.add(os.readlink(fd))
        except OSError:  # gone, or not ours to read
            continue
    return paths


@functools.cache
def build(op: str = COMM) -> str:
    """Builds an op now, in one process, once per session (seconds when it is already built).

    Args:
        op: ``COMM`` or ``CPU_ADAM``.

    Returns:
        The directory, for a ``TORCH_EXTENSIONS_DIR`` variable.
    """
    _remove_stale_locks(op)  # a build killed by a test's timeout
    subprocess.run([sys.executable, "-c", _LOAD[op]], env={**os.environ, "TORCH_EXTENSIONS_DIR": str(DIRECTORY)},
                   check=True, capture_output=True, timeout=1200)
    return str(DIRECTORY)
