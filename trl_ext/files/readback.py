"""The check after every save, before anything is committed: the files re-read and compared with what was planned
and trained (headers byte-identical, the first ``PREFIX_BYTES`` of each tensor, ``adapter_config.json``), plus the
``files.audit`` audit of their contents."""

import json
import os
from pathlib import Path

from trl_ext.files import audit
from trl_ext.files.header import DTYPE_CODES
from trl_ext.files.shards import PREFIX_BYTES, WrittenFile


def _read_as_planned(path: Path, specs: list, record: WrittenFile) -> dict[str, bytes] | None:
    """The fast path for a file just written: if it holds exactly the header that was written and the size that
    header implies, its tensors are the planned ones; only their prefixes are read. None otherwise."""
    if not record.header:
        return None
    sizes = [s.nbytes for s in specs]
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        if os.fstat(fd).st_size != len(record.header) + sum(sizes):
            return None
        if os.pread(fd, len(record.header), 0) != record.header:
            return None
        prefixes, offset = {}, len(record.header)
        for spec, size in zip(specs, sizes):
            prefixes[spec.name] = os.pread(fd, min(size, PREFIX_BYTES), offset)  # one read per tensor
            offset += size
    return prefixes


def check_files(root: Path, plan: dict, written: dict[str, WrittenFile]) -> tuple[list[str], dict, dict]:
    """The files this rank wrote (``plan``: those files only): each holds exactly the planned tensors (names, full
    shapes, dtypes), and each tensor's first bytes are the bytes that were written (``written``: the writer's record
    of each file). Reads each header and ``PREFIX_BYTES`` per tensor; a header that is not the one written is parsed
    in full, to say what differs.

    Returns:
        The problems, and what ``check_directory`` needs: ``{name: (shape, dtype code)}`` and each tensor's prefix.
    """
    problems, tensors, prefixes = [], {}, {}
    for filename, specs in plan.items():
        expected = {s.name: (list(s.shape), DTYPE_CODES[s.dtype]) for s in specs}
        record = written.get(filename, WrittenFile())
        try:
            read = _read_as_planned(root / filename, specs, record)
            found, read = (expected, read) if read is not None else audit.read_safetensors(root / filename)
        except audit.UNREADABLE as exc:
            problems.append(f"{filename}: cannot be read back ({exc})")
            continue
        missing = sorted(set(expected) - set(found))
        extra = sorted(set(found) - set(expected))
        wrong = sorted(n for n in set(expected) & set(found) if found[n] != expected[n])
        changed = [n for n, prefix in record.prefixes.items() if n in read and read[n] != prefix]
        if missing:
            problems.append(f"{filename}: {len(missing)} tensors missing, e.g. {missing[0]}")
        if extra:
            problems.append(f"{filename}: {len(extra)} unexpected tensors, e.g. {extra[0]}")
        for name in wrong[:5]:
            problems.append(f"{name}: written {found[name]}, trained {expected[name]}")
        if changed:
            problems.append(f"{filename}: bytes differ from the trained values for {', '.join(changed[:5])}")
        tensors.update(found)
        prefixes.update(read)
    return problems, tensors, prefixes


def check_directory(path: str, plan: dict, tensors: dict, prefixes: dict, peft_config=None,
                    num_labels: int = 1) -> list[str]:
    """The whole directory, once every file passed ``check_files``: the weight files are the planned ones, and the
    audit's checks pass on every tensor (``tensors``, ``prefixes``: ``check_files``' results, merged)."""
    root = Path(path)
    report = audit.Report(str(path))
    files = sorted(f.name for f in audit.weight_files(root, report))
    if not report.problems and files != sorted(plan):
        report.problems.append(f"the weight files are {files}, the save planned {sorted(plan)}")
    audit.check_contents(root, tensors, prefixes, report, None, num_labels)
    if peft_config is not None:
        report.problems += check_adapter_config(path, peft_config)
    return report.problems


def check_written(path: str, plan: dict, written: dict[str, WrittenFile], peft_config=None,
                  num_labels: int = 1) -> list[str]:
    """After a save by one writer, before it is committed: ``check_files`` on every file, then ``check_directory``."""
    problems, tensors, prefixes = check_files(Path(path), plan, written)
    return problems + check_directory(path, plan, tensors, prefixes, peft_config, num_labels)


def check_adapter_config(path: str, trained) -> list[str]:
    """``adapter_config.json`` must describe the adapter that was trained (``trained``: its PEFT config)."""
    config_path = Path(path) / "adapter_config.json"
    if not config_path.exists():
        return ["adapter_config.json was not written"]
    written = json.loads(config_path.read_text())
    problems = []
    for key in ("peft_type", "task_type", "target_modules", "modules_to_save", "r", "lora_alpha"):
        want = getattr(trained, key, None)
        want = getattr(want, "value", want)  # enums (PeftType, TaskType) are written as strings
        have = written.get(key)
        if isinstance(want, (set, list, tuple)) or isinstance(have, list):
            want, have = sorted(want or []), sorted(have or [])
        if want != have:
            problems.append(f"adapter_config.json: {key} is {have!r}, the trained adapter has {want!r}")
    return problems
