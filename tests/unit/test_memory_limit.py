"""A container's memory limit as the memory tier reads it (trl_ext/process/memory_limit.py): cgroup v2 and v1, the
tightest limit up the tree, the working set (usage less the inactive file cache), a container's own cgroup namespace,
no limit; and a tier the limit cannot hold is said in one line. The trees are made up in a temporary directory; the
reading was also checked by hand in a real v1 group with a 2 GiB limit (512 MiB written to /dev/shm took 0.5 GiB of
its room)."""

from pathlib import Path

from trl_ext.process import memory_limit
from trl_ext.saving.memory_tier import MemoryTier

GIB = 1 << 30


def _group(directory: Path, **files) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(str(text))


def test_cgroup_v2_counts_the_tightest_limit_up_the_tree_and_the_working_set(tmp_path):
    _group(tmp_path / "kubepods" / "pod1", memory_max=4 * GIB, memory_current=3 * GIB,
           memory_stat=f"anon 100\ninactive_file {GIB}\nactive_file 5\n")
    _group(tmp_path / "kubepods" / "pod1" / "trainer", memory_max="max", memory_current=2 * GIB)
    assert memory_limit.room_left("0::/kubepods/pod1/trainer\n", tmp_path) == (2 * GIB, 4 * GIB)


def test_a_containers_own_namespace_shows_its_group_as_the_root(tmp_path):
    _group(tmp_path, memory_max=GIB, memory_current=GIB // 4)
    assert memory_limit.room_left("0::/\n", tmp_path) == (3 * GIB // 4, GIB)
    assert memory_limit.room_left("0::/not/seen/here\n", tmp_path) == (3 * GIB // 4, GIB)


def test_cgroup_v1_reads_the_memory_hierarchy_and_its_no_limit_value(tmp_path):
    unlimited = 9223372036854771712
    _group(tmp_path / "memory" / "kubepods", memory_limit_in_bytes=2 * GIB, memory_usage_in_bytes=GIB,
           memory_stat="total_inactive_file 0\n")
    _group(tmp_path / "memory" / "kubepods" / "x", memory_limit_in_bytes=unlimited, memory_usage_in_bytes=GIB)
    assert memory_limit.room_left("12:memory:/kubepods/x\n11:cpu,cpuacct:/kubepods/x\n0::/\n", tmp_path) == \
        (GIB, 2 * GIB)
    _group(tmp_path / "memory", memory_limit_in_bytes=unlimited, memory_usage_in_bytes=GIB)
    assert memory_limit.room_left("4:memory:/\n", tmp_path) is None  # a machine with no limit


def test_no_control_group_files_is_no_limit(tmp_path):
    assert memory_limit.room_left("0::/\n", tmp_path) is None
    assert memory_limit.room_left("", tmp_path) is None


def test_a_tier_the_containers_limit_cannot_hold_is_said_in_one_line(tmp_path, monkeypatch):
    tier = MemoryTier(tmp_path / "shm" / "key", 2, str(tmp_path / "out"))
    monkeypatch.setattr(memory_limit, "room_left", lambda: (GIB, 8 * GIB))
    why = tier.room(GIB)  # two checkpoints of 1 GiB, 1 GiB left under the limit
    assert why.startswith("two checkpoints (2.00 GiB) do not fit under this container's memory limit (1.00 GiB left "
                          "of 8.00 GiB"), why
    assert "give the pod more memory" in why
    assert tier.room(GIB // 4) is None
