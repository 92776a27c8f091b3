"""An output directory whose file system cannot rename a directory (an object-store mount) is refused at start in one
line naming the fixes; one that can is accepted and left as it was. The rename is made to fail as mountpoint-s3 fails
it (``OSError(EXDEV/ENOTSUP)`` from ``os.rename``)."""

import errno
import os
from types import SimpleNamespace

import pytest

from trl_ext.errors import UsageError
from trl_ext.launching import rename_probe, scripting


def _mount_without_rename(monkeypatch, under):
    """``os.rename`` fails for anything under ``under``, as on an object-store mount; elsewhere it works."""
    real = os.rename

    def rename(src, dst, *args, **kwargs):
        if str(src).startswith(str(under)):
            raise OSError(errno.ENOTSUP, "Operation not supported", str(src))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)


def test_a_file_system_that_renames_is_accepted_and_left_clean(tmp_path):
    out = tmp_path / "run"
    rename_probe.check_renames(out)  # not created yet: probed in its parent
    assert not out.exists() and list(tmp_path.iterdir()) == []
    out.mkdir()
    (out / "keep.txt").write_text("x")
    rename_probe.check_renames(out)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_a_mount_without_rename_is_refused_in_one_line_naming_the_fixes(tmp_path, monkeypatch):
    mount = tmp_path / "bucket"
    mount.mkdir()
    _mount_without_rename(monkeypatch, mount)
    with pytest.raises(UsageError) as refused:
        rename_probe.check_renames(mount / "dpo")
    message = str(refused.value)
    assert "\n" not in message and "cannot rename a directory (ENOTSUP" in message
    assert all(fix in message for fix in ("MOUNT_CACHED", "a shared file system", "--checkpoint_mirror"))
    assert list(mount.iterdir()) == []  # the scratch directory is gone
    rename_probe.check_renames(tmp_path / "elsewhere")  # another file system of the same machine: accepted


def test_a_directory_that_cannot_be_written_is_left_to_trl(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "mkdir", refuse)
    rename_probe.check_renames(tmp_path / "run")  # not a rename failure: no refusal here (TRL's save says it)


def test_the_recipes_refuse_it_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mount = tmp_path / "bucket"
    mount.mkdir()
    _mount_without_rename(monkeypatch, mount)
    args = SimpleNamespace(output_dir=str(mount / "dpo"), resume_from_checkpoint=None)
    with pytest.raises(UsageError, match="MOUNT_CACHED"):
        scripting.prepare_output_dir(args, "dpo")
