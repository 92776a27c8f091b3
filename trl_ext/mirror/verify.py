"""``trl-ext verify URL``: a mirrored checkpoint or model checked where it lies: every file of its manifest there, of
its size and checksum (read through once, in parallel), and every safetensors file's header read and checked (sizes
match shapes, offsets contiguous, nothing truncated). A URL without a manifest is listed: its complete and incomplete
checkpoints.
"""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from trl_ext.files import header
from trl_ext.mirror.store import Store, first_line

FILES_IN_PARALLEL = 4


@dataclass
class RemoteReport:
    """What ``verify`` found: one line per problem, and what it checked."""

    url: str
    problems: list[str] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    tensors: int = 0
    headers: int = 0
    listing: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.files > 0

    def format(self) -> str:
        lines = [f"{self.url}:"]
        lines += [f"  {line}" for line in self.listing]
        lines += [f"  PROBLEM: {p}" for p in self.problems]
        if self.files:
            verdict = "match their manifest" if not self.problems else "checked"
            lines.append(f"  {self.files} files, {self.bytes / 2**20:.1f} MiB, {verdict}; {self.headers} safetensors "
                         f"headers read ({self.tensors} tensors)")
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)


def _check_header(store: Store, rel: str, size: int) -> int:
    """The number of tensors in the safetensors file ``rel`` (two ranged reads: the length, then the header)."""
    claimed = header.length(store.read_head(rel, 8), size)
    raw = store.fs.cat_file(store.path(rel), start=8, end=8 + claimed)
    return len(header.parse(raw, size).entries)


def verify(url: str, storage_options: dict | None = None) -> RemoteReport:
    """Check the checkpoint or model at ``url`` against its manifest.

    Args:
        url: a mirrored ``checkpoint-N`` (``s3://bucket/run/checkpoint-20``) or model (the mirror's top).
        storage_options: fsspec storage options (the standard credential chains need none).

    Returns:
        The ``RemoteReport`` (``ok``, ``format()``).
    """
    store = Store(url, storage_options)
    report = RemoteReport(store.shown)
    try:
        wanted = store.read_manifest("")
    except FileNotFoundError:
        found = store.checkpoints()
        report.problems.append("no trl_ext-manifest.json here: not a complete mirrored checkpoint or model")
        report.listing = [f"checkpoint-{s}: {'complete' if done else 'incomplete (no manifest)'}"
                          for s, done in sorted(found.items())]
        return report
    except ValueError as exc:
        report.problems.append(f"trl_ext-manifest.json cannot be read: {exc}")
        return report

    def one(name: str) -> tuple[list[str], int, int]:
        problems, tensors, headers = [], 0, 0
        try:
            size, digest = store.download(name, None)
        except Exception as exc:  # noqa: BLE001 - the store's own kinds, said as the file's problem
            return [f"{name}: cannot be read ({first_line(exc)})"], 0, 0
        mismatch = wanted.mismatch(name, size, digest)
        if mismatch:
            problems.append(mismatch)
        elif name.endswith(".safetensors"):
            try:
                tensors, headers = _check_header(store, name, size), 1
            except Exception as exc:  # noqa: BLE001 - a bad header in any form is the file's problem
                problems.append(f"{name}: its safetensors header is invalid ({first_line(exc)})")
        return problems, tensors, headers

    with ThreadPoolExecutor(max_workers=FILES_IN_PARALLEL) as pool:
        for problems, tensors, headers in pool.map(one, sorted(wanted.files)):
            report.problems += problems
            report.tensors += tensors
            report.headers += headers
    report.files, report.bytes = len(wanted.files), wanted.total_bytes
    return report


def is_url(path: str) -> bool:
    """Whether ``path`` names a remote location (``s3://...``), not a local directory."""
    return "://" in str(path)
