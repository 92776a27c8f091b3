"""Build an embedded asset once per machine: under a file lock, in a clean process, committed by one rename."""

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from trl_ext.errors import SetupError
from trl_ext.settings import environment


def cache_root() -> Path:
    return Path(environment.CACHE.text())


def cached_build(name: str, builder_module: str, *builder_args: str, marker: str = "config.json") -> str:
    """Return ``cache_root()/name``, building it first with ``python -m builder_module ARGS DIR`` if it is missing.

    The build runs in a fresh interpreter: in the caller's process, an initialised process group (transformers'
    ``save_pretrained`` then writes weights on rank 0 only) or an active ZeRO-3 context would change what is
    written. Concurrent callers (every rank of a first multi-process run) wait on one lock; one of them builds.

    Args:
        name: The directory name under the cache root; bump it when the build changes.
        builder_module: A module whose ``__main__`` writes the asset into the directory given as its last argument.
        builder_args: Arguments given to the builder before the directory.
        marker: A file, relative to the directory, that every finished build contains.

    Returns:
        The path of the built asset.
    """
    target = cache_root() / name
    if (target / marker).exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / marker).exists():
            if target.exists():  # a leftover that is not a finished build
                shutil.rmtree(target)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any model directory
            try:
                proc = subprocess.run([sys.executable, "-m", builder_module, *builder_args, str(tmp)],
                                      capture_output=True, text=True, check=False)
                if proc.returncode != 0 or not (tmp / marker).exists():
                    raise SetupError(f"building {name} failed:\n{proc.stderr[-4000:]}")
                os.rename(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
