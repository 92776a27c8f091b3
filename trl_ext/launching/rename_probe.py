"""Can the output directory's file system rename a directory? Every checkpoint and saved model is committed by renaming
its finished partial directory into place (``files.commit``). Object-store mounts (mountpoint-s3, gcsfuse without
its rename support, SkyPilot's ``mode: MOUNT``) do not emulate that rename: the first checkpoint would fail after the
first ``save_steps`` of training. Tried once at start, with a scratch directory, and refused in one line only when the
rename really fails (never stricter than TRL: a directory that cannot even be created is left to TRL's own error).
"""

import errno
import os
import shutil
import uuid
from pathlib import Path

from trl_ext.errors import UsageError

PROBE_PREFIX = ".trl_ext-rename-probe-"


def _nearest_existing(path: Path) -> Path:
    """The directory itself, else its nearest existing parent: where a directory not created yet will live."""
    path = path.absolute()
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return path


def check_renames(output_dir: str | os.PathLike) -> None:
    """Refuse ``output_dir`` when a directory on its file system cannot be renamed.

    The probe is a scratch directory beside where the run writes (in ``output_dir``, or its nearest existing parent
    when it does not exist yet, so that nothing is left behind), holding one file, renamed once and removed.

    Args:
        output_dir: the run's output directory.

    Raises:
        UsageError: the rename failed; the message names the fixes.
    """
    where = _nearest_existing(Path(output_dir))
    scratch = where / f"{PROBE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    partial, committed = scratch / "partial", scratch / "committed"
    try:
        partial.mkdir(parents=True)
        (partial / "probe").write_bytes(b"trl_ext")
    except OSError:  # not writable at all: TRL's own save says so, as it would without trl_ext
        shutil.rmtree(scratch, ignore_errors=True)
        return
    try:
        os.rename(partial, committed)
    except OSError as exc:
        reason = errno.errorcode.get(exc.errno, "") if exc.errno else ""
        raise UsageError(
            f"output_dir {output_dir}: its file system cannot rename a directory ({reason or type(exc).__name__}: "
            f"{exc.strerror or exc}), and every checkpoint is committed by one. Object-store mounts do not emulate "
            "rename: use SkyPilot's MOUNT_CACHED mode, a shared file system (NFS, a ReadWriteMany volume), or a "
            "local disk plus --checkpoint_mirror s3://bucket/run.") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
