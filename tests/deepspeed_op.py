"""DeepSpeed's CPU communication op (``deepspeed_shm_comm``), which every DeepSpeed process on a CPU loads through
torch's JIT builder, in a directory of this test environment's own, built once before any launch needs it.

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
_BUILD = "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load(verbose=False)"


def use_own_directory() -> None:
    """Points this process (and the launches it makes) at ``DIRECTORY`` and removes the locks a killed build left
    there (no process holds them open; a live builder keeps its lock's descriptor open, and another test session,
    the Slurm leg's, may be building now): called once when a test session starts, before any of its launches."""
    os.environ["TORCH_EXTENSIONS_DIR"] = str(DIRECTORY)
    locks = list(DIRECTORY.glob("*/*/lock"))
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
def build() -> str:
    """Builds the op now, in one process, once per session (seconds when it is already built).

    Returns:
        The directory, for a ``TORCH_EXTENSIONS_DIR`` variable.
    """
    subprocess.run([sys.executable, "-c", _BUILD], env={**os.environ, "TORCH_EXTENSIONS_DIR": str(DIRECTORY)},
                   check=True, capture_output=True, timeout=600)
    return str(DIRECTORY)
