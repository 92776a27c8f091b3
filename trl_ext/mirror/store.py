"""The object store a mirror writes to, through fsspec (``s3://`` with s3fs, ``gs://`` with gcsfs, ``az://`` with
adlfs, ``hf://`` with huggingface_hub, ``file://`` and ``memory://`` with fsspec itself), and the refusals before
training: the credentials, the bucket, the permission to write and delete, each said in one line.

Paths below the mirror's URL are relative (``checkpoint-20/model.safetensors``). Transfers stream a file through the
store's own file object (multipart uploads and ranged reads where the store has them, parts of ``PART_BYTES``),
computing the file's checksum on the bytes as they pass.
"""

import contextlib
import json
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path

from trl_ext.errors import ABANDONED, LOCAL_FILE, MirrorError
from trl_ext.mirror import manifest, multipart, options

PART_BYTES = 32 * 2**20  # a multipart upload's part and a download's ranged read
READ_BYTES = 8 * 2**20  # local reads and writes
RUN_MARKER = "trl_ext-mirror-run.json"  # at the mirror's top: which run writes to it (``lease``)
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_CHUNKED = ("s3", "s3a", "gs", "gcs")  # stores whose files take a part size and uncached ranged reads
# s3: fail fast on a store that stopped answering and leave the retrying to the uploader, which warns meanwhile
# (and check what we read ourselves: botocore checks a ranged read against the whole object's checksum, and fails)
_S3_CONFIG = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2, "mode": "standard"},
              "response_checksum_validation": "when_required"}


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class Store:
    """One mirror's prefix in its store.

    Args:
        url: the mirror's URL (``s3://bucket/run``).
        storage_options: fsspec storage options, secrets concealed (``options.conceal``).
    """

    def __init__(self, url: str, storage_options: dict | None = None):
        import fsspec

        self.url = options.check_url(url)
        self.shown = options.shown(self.url)
        kwargs = options.reveal(dict(storage_options or {}))
        protocol = fsspec.core.split_protocol(self.url)[0] or "file"
        self.protocol = protocol
        if protocol in ("s3", "s3a"):
            kwargs["config_kwargs"] = {**_S3_CONFIG, **kwargs.get("config_kwargs", {})}
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **kwargs)
        except ImportError as exc:
            extra = "pip install 'trl_ext[mirror]'" if protocol in ("s3", "s3a") else "install its fsspec package"
            raise MirrorError(f"checkpoint_mirror {self.shown}: {first_line(exc)} ({extra})") from None
        except (ValueError, TypeError) as exc:
            raise MirrorError(f"checkpoint_mirror {self.shown}: {first_line(exc)}") from None
        self.root = self.root.rstrip("/")
        self.local = protocol in ("file", "local", "memory")

    def path(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def url_of(self, rel: str = "") -> str:
        return f"{self.shown}/{rel}" if rel else self.shown

    # ------------------------------------------------------------------------------------------------- checks
    def check_access(self) -> None:
        """Write, read back and delete a small probe object at the mirror's top: the credentials, the bucket and the
        permissions a mirror needs, before anything trains.

        Raises:
            MirrorError: one line naming what failed and how to fix it.
        """
        probe = f".trl_ext-probe-{uuid.uuid4().hex}"
        step = "write to"
        try:
            if self.local:
                self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(self.path(probe), b"trl_ext mirror probe")
            step = "read from"
            if self.fs.cat_file(self.path(probe)) != b"trl_ext mirror probe":
                raise MirrorError(f"checkpoint_mirror {self.shown}: an object written there reads back different")
            step = "delete from"
            self.fs.rm_file(self.path(probe))
        except MirrorError:
            raise
        except Exception as exc:  # noqa: BLE001 - every store raises its own kinds; each becomes one line
            raise MirrorError(f"checkpoint_mirror {self.shown}: cannot {step} it ({first_line(exc)}). "
                              f"{_fix(exc, self.protocol)}") from None

    # ---------------------------------------------------------------------------------------------- listing
    def refresh(self) -> None:
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache()

    def checkpoints(self) -> dict[int, bool]:
        """The ``checkpoint-N`` folders under the mirror: step -> whether it is complete (its manifest is there)."""
        self.refresh()
        try:
            names = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return {}
        steps = sorted(int(m.group(1)) for n in names if (m := CHECKPOINT.match(n)))
        return {step: self.exists(f"checkpoint-{step}/{manifest.NAME}") for step in steps}

    def complete(self) -> list[int]:
        """The steps of the complete mirrored checkpoints, newest first."""
        return sorted((s for s, done in self.checkpoints().items() if done), reverse=True)

    def exists(self, rel: str) -> bool:
        try:
            return bool(self.fs.exists(self.path(rel)))
        except FileNotFoundError:
            return False

    def read_manifest(self, rel: str) -> manifest.Manifest:
        """The manifest of the checkpoint or model at ``rel`` (``checkpoint-20``; ``""`` for the top).

        Raises:
            FileNotFoundError: it has none (not complete); ValueError: it is not a manifest.
        """
        return manifest.Manifest.from_json(self.fs.cat_file(self.path(f"{rel}/{manifest.NAME}" if rel
                                                                      else manifest.NAME)))

    def write_manifest(self, rel: str, content: manifest.Manifest) -> None:
        self.fs.pipe_file(self.path(f"{rel}/{manifest.NAME}" if rel else manifest.NAME), content.to_json().encode())

    def read_json(self, rel: str) -> dict | None:
        try:
            return json.loads(self.fs.cat_file(self.path(rel)))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}

    def write_json(self, rel: str, value: dict) -> None:
        self.fs.pipe_file(self.path(rel), json.dumps(value, indent=1).encode())

    def files(self, rel: str) -> list[str]:
        """Every file under ``rel``, relative to it."""
        base = self.path(rel).rstrip("/")
        try:
            found = self.fs.find(base, detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(p)[len(base) + 1:] for p in found if str(p).startswith(base + "/"))

    def delete(self, rel: str, recursive: bool = True) -> None:
        """Remove ``rel`` (a file or folder); nothing if it is not there."""
        with contextlib.suppress(FileNotFoundError):
            if recursive and rel:
                self.fs.rm(self.path(rel), recursive=True)
            else:
                self.fs.rm_file(self.path(rel))

    def abort_uploads(self, rel: str) -> int:
        """Abort unfinished multipart uploads under ``rel`` (S3 keeps and bills their parts), where the store lists
        them; the number aborted (0 where it cannot tell)."""
        if self.protocol not in ("s3", "s3a"):
            return 0
        bucket, _, prefix = self.path(rel).partition("/")
        aborted = 0
        try:
            listed = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
            for upload in listed.get("Uploads", []):
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"],
                                UploadId=upload["UploadId"])
                aborted += 1
        except Exception:  # noqa: BLE001 - a store without the listing: the parts expire by its lifecycle rules
            return aborted
        return aborted

    # ------------------------------------------------------------------------------------------------ transfers
    def upload(self, local: Path, rel: str, cancelled: Callable[[], bool] = lambda: False) -> tuple[int, str]:
        """Stream ``local`` to ``rel``, computing its checksum on the bytes as they are read for the upload. An
        interrupted upload is discarded (its multipart upload aborted) where the store can.

        Returns:
            ``(size, checksum)`` of what was uploaded.

        Raises:
            MirrorError: ``local`` cannot be read (kind ``LOCAL_FILE``), or ``cancelled()`` became true (kind
                ``ABANDONED``). Anything the store raises (the caller retries).
        """
        try:
            source = open(local, "rb")  # noqa: SIM115 - closed below, with the remote file
        except OSError as exc:
            raise MirrorError(f"{local}: {first_line(exc)}", kind=LOCAL_FILE) from exc
        digest, size = manifest.hasher(), 0
        if self.protocol in ("s3", "s3a") and hasattr(self.fs, "_call_s3"):  # parts in parallel, as s3fs's put_file
            with source:
                size = multipart.upload(self.fs, self.path(rel), source, os.fstat(source.fileno()).st_size, digest,
                                        cancelled)
            return size, digest.hexdigest()
        target = None
        try:
            kwargs = {"block_size": PART_BYTES} if self.protocol in _CHUNKED else {}
            if self.local:
                self.fs.makedirs(self.fs._parent(self.path(rel)), exist_ok=True)
            target = self.fs.open(self.path(rel), "wb", **kwargs)
            while True:
                chunk = multipart.read_chunk(source, READ_BYTES, digest, cancelled, rel)
                if not chunk:
                    break
                target.write(chunk)
                size += len(chunk)
            target.close()
            target = None
        finally:
            source.close()
            if target is not None:  # failed or abandoned: never complete the object
                with contextlib.suppress(Exception):
                    target.discard() if hasattr(target, "discard") else None
        return size, digest.hexdigest()

    def download(self, rel: str, local: Path | None, cancelled: Callable[[], bool] = lambda: False
                 ) -> tuple[int, str]:
        """Stream ``rel`` into ``local`` (written, flushed and fsynced; None: only read), computing its checksum as
        it arrives.

        Returns:
            ``(size, checksum)`` of what was downloaded.
        """
        kwargs = {"block_size": PART_BYTES, "cache_type": "none"} if self.protocol in _CHUNKED else {}
        digest, size = manifest.hasher(), 0
        if local is not None:
            local.parent.mkdir(parents=True, exist_ok=True)
        with self.fs.open(self.path(rel), "rb", **kwargs) as source, \
                (open(local, "wb") if local is not None else contextlib.nullcontext()) as target:
            while True:
                if cancelled():
                    raise MirrorError(f"the transfer of {rel} was stopped", kind=ABANDONED)
                chunk = source.read(PART_BYTES)
                if not chunk:
                    break
                digest.update(chunk)
                if target is not None:
                    target.write(chunk)
                size += len(chunk)
            if target is not None:
                target.flush()
                os.fsync(target.fileno())
        return size, digest.hexdigest()

    def read_head(self, rel: str, nbytes: int) -> bytes:
        """The first ``nbytes`` of ``rel`` (one ranged read)."""
        return self.fs.cat_file(self.path(rel), start=0, end=nbytes)

    def size(self, rel: str) -> int:
        return int(self.fs.info(self.path(rel))["size"])


def _fix(exc: BaseException, protocol: str) -> str:
    """How to fix an access failure, by its kind."""
    s3 = protocol in ("s3", "s3a")
    if isinstance(exc, PermissionError) or "Credentials" in type(exc).__name__:  # botocore's NoCredentialsError...
        return ("Check the credentials (for S3: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or "
                "mirror_storage_options' key and secret) and that they may write and delete there." if s3 else
                "Check the credentials and that they may write and delete there.")
    if isinstance(exc, FileNotFoundError):
        return "Create the bucket first, or correct its name." if s3 else "Create it first, or correct the URL."
    return ("Check the endpoint (for S3-compatible stores: AWS_ENDPOINT_URL, or mirror_storage_options' "
            "endpoint_url) and the network." if s3 else "Check the URL and the network.")
