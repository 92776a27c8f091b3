"""How much more memory this process's control group lets it take: a container's (a Kubernetes pod's) memory limit,
which the machine's free memory does not show. Files in a tmpfs such as /dev/shm count against the group of the
process that wrote them, so a memory tier larger than what the limit leaves ends in the kernel's OOM kill of the pod.

cgroup v2 (``memory.max``, ``memory.current``) and v1 (``memory.limit_in_bytes``, ``memory.usage_in_bytes``), the
tightest over the group and its ancestors. Usage counts as kubelet counts it, its working set: less the inactive file
cache (``inactive_file``), which the kernel reclaims before it kills. psutil reads neither (it reports the machine's
memory), hence this module.
"""

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" or not text.isdigit() else int(text)


def _inactive_file(directory: Path, key: str) -> int:
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _groups(proc_cgroup: str, root: Path) -> list[tuple[Path, str]]:
    """The memory group's directory of each hierarchy this process is in, and its version: ``(directory, "v2")``."""
    found = []
    for line in proc_cgroup.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":
            found.append((root / path.lstrip("/"), "v2"))
        elif "memory" in controllers.split(","):
            found.append((root / "memory" / path.lstrip("/"), "v1"))
    return found


def _left_in(directory: Path, version: str, top: Path) -> tuple[int, int] | None:
    """``(room, limit)`` under the tightest limit of ``directory`` and its ancestors up to ``top``, or None without
    one. A group not seen at its path (a container's own cgroup namespace shows it as the root) is read at ``top``."""
    if not directory.is_dir():
        directory = top
    limit_file, usage_file, inactive = (("memory.max", "memory.current", "inactive_file") if version == "v2" else
                                        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    tightest = None
    while True:
        limit = _read_int(directory / limit_file)
        if limit is not None and limit < UNLIMITED:
            usage = _read_int(directory / usage_file) or 0
            room = max(limit - max(usage - _inactive_file(directory, inactive), 0), 0)
            if tightest is None or room < tightest[0]:
                tightest = (room, limit)
        if directory == top or top not in directory.parents:
            return tightest
        directory = directory.parent


def room_left(proc_cgroup: str | None = None, root: Path = CGROUP_ROOT) -> tuple[int, int] | None:
    """The bytes this process's memory control group can still take, and that group's limit (the tightest one up its
    tree).

    Args:
        proc_cgroup: the text of ``/proc/self/cgroup`` (default: read it).
        root: where the cgroup file systems are mounted.

    Returns:
        ``(room, limit)`` in bytes, or None where no memory limit applies (or none can be read).
    """
    if proc_cgroup is None:
        try:
            proc_cgroup = Path(f"/proc/{os.getpid()}/cgroup").read_text()
        except OSError:
            return None
    found = [_left_in(directory, version, root if version == "v2" else root / "memory")
             for directory, version in _groups(proc_cgroup, root)]
    found = [left for left in found if left is not None]
    return min(found) if found else None
