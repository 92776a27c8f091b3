"""A mirrored checkpoint brought back: its files downloaded in parallel into a hidden partial directory of the output
directory, each checked against the manifest as it arrives, then committed as ``checkpoint-N`` (one rename). A file
that does not match is refused, and the next older complete checkpoint is tried.
"""

import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from trl_ext.errors import MirrorError
from trl_ext.files.commit import PARTIAL_SUFFIX, replace_dir, sync_files
from trl_ext.mirror.store import Store, first_line

FILES_IN_PARALLEL = 4


def _fetch(store: Store, rel: str, local: Path) -> tuple[int, str]:
    """Download one file; the store's client has retried each request (S3: botocore's and s3fs's retries)."""
    try:
        return store.download(rel, local)
    except Exception as exc:  # noqa: BLE001 - the store's own kinds
        raise MirrorError(f"checkpoint_mirror {store.url_of(rel)}: the download failed ({first_line(exc)})") from None


def download(store: Store, step: int, output_dir: str | Path) -> Path:
    """Download mirrored ``checkpoint-<step>`` into ``output_dir``, checked against its manifest.

    Args:
        store: the mirror.
        step: a complete checkpoint's step.
        output_dir: the run's output directory.

    Returns:
        The committed local ``checkpoint-<step>``.

    Raises:
        MirrorError: a file does not match its manifest (kind "mirror", ``detail`` the file's line), or the store
            failed; nothing is committed locally.
    """
    rel = f"checkpoint-{step}"
    output_dir = Path(output_dir)
    try:
        wanted = store.read_manifest(rel)
    except (FileNotFoundError, ValueError) as exc:
        raise MirrorError(f"{store.url_of(rel)}: its manifest cannot be read ({first_line(exc)})",
                          detail="manifest") from None
    partial_run = output_dir / f".{rel}{PARTIAL_SUFFIX}"
    shutil.rmtree(partial_run, ignore_errors=True)
    partial = partial_run / rel
    partial.mkdir(parents=True)

    def one(name: str) -> str | None:
        size, digest = _fetch(store, f"{rel}/{name}", partial / name)
        return wanted.mismatch(name, size, digest)

    try:
        with ThreadPoolExecutor(max_workers=FILES_IN_PARALLEL, thread_name_prefix="trl_ext-mirror-get") as pool:
            names = sorted(wanted.files, key=lambda n: -wanted.files[n]["size"])
            problems = [p for p in pool.map(one, names) if p]
        if problems:
            raise MirrorError(f"{store.url_of(rel)} does not match its manifest: {problems[0]}"
                              + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""), detail=problems[0])
        sync_files(partial)
        replace_dir(partial, output_dir / rel)
    finally:
        shutil.rmtree(partial_run, ignore_errors=True)
    return output_dir / rel


def newest(store: Store, output_dir: str | Path, say: Callable[[str], None]) -> Path | None:
    """The newest complete mirrored checkpoint that downloads and matches its manifest; a mismatching one is refused
    in one line and the next older is tried.

    Returns:
        The local checkpoint, or None when the mirror holds no complete checkpoint that matches.

    Raises:
        MirrorError: the store failed (not a mismatch).
    """
    for step in store.complete():
        started = time.monotonic()
        try:
            path = download(store, step, output_dir)
        except MirrorError as exc:
            if exc.detail is None:
                raise
            say(f"refused {store.url_of(f'checkpoint-{step}')}: {exc}; trying the next older checkpoint")
            continue
        say(f"downloaded {store.url_of(f'checkpoint-{step}')} into {path} in {time.monotonic() - started:.1f} s, "
            "checked against its manifest")
        return path
    return None
