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
    """Points this process (and the launches it makes) at ``DIRECTORY`` and removes the locks left there: called once
    when a test session starts, before any of its launches, so a lock found now is one a killed build left."""
    os.environ["TORCH_EXTENSIONS_DIR"] = str(DIRECTORY)
    for lock in DIRECTORY.glob("*/*/lock"):
        lock.unlink(missing_ok=True)


@functools.cache
def build() -> str:
    """Builds the op now, in one process, once per session (seconds when it is already built).

    Returns:
        The directory, for a ``TORCH_EXTENSIONS_DIR`` variable.
    """
    subprocess.run([sys.executable, "-c", _BUILD], env={**os.environ, "TORCH_EXTENSIONS_DIR": str(DIRECTORY)},
                   check=True, capture_output=True, timeout=600)
    return str(DIRECTORY)
