"""tests/deepspeed_op.py: a build lock left by a killed build is removed (it would hang every later launch); one that a
live builder holds open is kept."""

import os

from tests import deepspeed_op


def test_only_the_locks_no_process_holds_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(deepspeed_op, "DIRECTORY", tmp_path)
    left = tmp_path / "cpu_adam" / "lock"  # TORCH_EXTENSIONS_DIR/<op>/lock: a build killed by a test's timeout
    building = tmp_path / "deepspeed_shm_comm" / "lock"
    default_layout = tmp_path / "py311_cpu" / "cpu_adam" / "lock"  # torch's layout without TORCH_EXTENSIONS_DIR
    for lock in (left, building, default_layout):
        lock.parent.mkdir(parents=True)
        lock.touch()
    held = os.open(building, os.O_RDONLY)  # as torch's FileBaton holds its lock while it builds
    try:
        deepspeed_op._remove_stale_locks(deepspeed_op.CPU_ADAM)
        assert not left.exists() and not default_layout.exists() and building.exists()
        left.touch()
        deepspeed_op._remove_stale_locks("*")
        assert not left.exists() and building.exists()
    finally:
        os.close(held)
    deepspeed_op._remove_stale_locks("*")
    assert not building.exists()
