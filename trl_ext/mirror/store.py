"""The object store a mirror writes to, through fsspec (``s3://`` with s3fs, ``gs://`` with gcsfs, ``az://`` with
adlfs, ``hf://`` with huggingface_hub, ``file://`` and ``memory://`` with fsspec itself), and the refusals before
training: the credentials, the bucket, the permission to write and delete, each said in one line.

Paths below the mirror's URL are relative (``checkpoint-20/model.safetensors``). Uploads are the store's own
``put_file`` (S3: s3fs's multipart upload, parts in parallel), each file hashed as it is read locally; downloads
stream through the store's own file object (uncached ranged reads where the store has them), hashed as they arrive.
Each request is retried by the store's client (S3: botocore's standard retry mode), which tells ``on_retry``'s
callback of every failed attempt. ``create`` writes a file only if it is absent, atomically where the store can.
"""

import contextlib
import json
import os
import uuid
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

from fsspec.callbacks import Callback

from trl_ext.errors import ABANDONED, LOCAL_FILE, MirrorError
from trl_ext.files import checkpoint_dirs as checkpoints
from trl_ext.files import manifest
from trl_ext.mirror import options

PART_BYTES = 32 * 2**20  # a download's ranged read
UPLOAD_PART_BYTES = 16 * 2**20  # an S3 multipart upload's part (S3's minimum is 5 MiB; fewer requests cost less)
PARTS_IN_FLIGHT = 4  # per file: with 4 files at once, 16 parts (256 MiB) in memory at most
READ_BYTES = 8 * 2**20  # local reads and writes
_S3 = ("s3", "s3a")
_CHUNKED = (*_S3, "gs", "gcs")  # stores whose files take a part size and uncached ranged reads
# stores whose create-if-absent is atomic: S3's conditional writes (If-None-Match), GCS's generation preconditions
# (ifGenerationMatch=0), Azure's (If-None-Match), a local file system's hard link (``create``)
_ATOMIC_CREATE = (*_S3, "gs", "gcs", "az", "abfs", "abfss", "file", "local")
# s3: botocore's standard retry mode, its exponential backoff with jitter (up to 1, 2, 4, 8 s: 15 s at most) between 5
# attempts; a store still failing then is the uploader's to wait for (it sends the checkpoint again later). Check what
# we read ourselves: botocore checks a ranged read against the whole object's checksum, and fails.
S3_ATTEMPTS = 5
_S3_CONFIG = {"connect_timeout": 5, "read_timeout": 60, "retries": {"total_max_attempts": S3_ATTEMPTS,
                                                                       "mode": "standard"},
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
        if protocol in _S3:
            kwargs["config_kwargs"] = {**_S3_CONFIG, **kwargs.get("config_kwargs", {})}
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **kwargs)
        except ImportError as exc:
            extra = "pip install s3fs" if protocol in _S3 else "install its fsspec package"
            raise MirrorError(f"checkpoint_mirror {self.shown}: {first_line(exc)} ({extra})") from None
        except (ValueError, TypeError) as exc:
            raise MirrorError(f"checkpoint_mirror {self.shown}: {first_line(exc)}") from None
        self.root = self.root.rstrip("/")
        self.local = protocol in ("file", "local", "memory")
        self._failed: Callable[[BaseException], None] | None = None
        self._watched = None  # the S3 client whose retries call ``_failed``

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
        steps = sorted(step for n in names if (step := checkpoints.step_of(n)) is not None)
        return {step: self.exists(f"{checkpoints.name(step)}/{manifest.NAME}") for step in steps}

    def complete(self) -> list[int]:
        """The steps of the complete mirrored checkpoints, newest first."""
        return sorted((s for s, done in self.checkpoints().items() if done), reverse=True)

    def names(self, rel: str) -> list[str]:
        """The names of the entries directly under the folder ``rel``, as the store lists them now (nothing cached)."""
        self.refresh()
        try:
            return sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path(rel), detail=False))
        except FileNotFoundError:
            return []

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
        """Write ``rel`` whole: a reader sees the old content or the new, never a part."""
        content = json.dumps(value, indent=1).encode()
        if self.protocol in ("file", "local"):  # own code: fsspec's local write truncates, then writes in place
            temporary = f"{self.path(rel)}.{uuid.uuid4().hex}.tmp"
            with open(temporary, "wb") as out:
                out.write(content)
            os.replace(temporary, self.path(rel))
        else:
            self.fs.pipe_file(self.path(rel), content)

    def create(self, rel: str, content: bytes) -> bool:
        """Write ``rel`` only if it does not exist: atomically where the store can (``atomic_create``), so that of two
        writers that create the same file at once exactly one succeeds.

        Returns:
            True if this call created it, False if it existed.
        """
        path = self.path(rel)
        if self.protocol in ("file", "local"):
            # own code: fsspec's local create checks, then writes; a hard link of a complete file is atomic
            os.makedirs(os.path.dirname(path), exist_ok=True)
            temporary = f"{path}.{uuid.uuid4().hex}.tmp"
            with open(temporary, "wb") as out:
                out.write(content)
            try:
                os.link(temporary, path)
            except FileExistsError:
                return False
            finally:
                os.unlink(temporary)
            return True
        if self.atomic_create is None:
            return self._create_if_absent(path, content)
        if self.exists(rel):  # check, then write: what fsspec's generic create does
            return False
        self.fs.pipe_file(path, content)
        return True

    def _create_if_absent(self, path: str, content: bytes) -> bool:
        try:
            self.fs.pipe_file(path, content, mode="create")  # s3fs: If-None-Match; gcsfs: ifGenerationMatch=0...
        except FileExistsError:
            return False
        return True

    @cached_property
    def atomic_create(self) -> str | None:
        """None where ``create`` is atomic here; else why not, in a few words. A store that knows conditional writes
        is asked to refuse a second create of a probe file (an S3-compatible server may ignore the condition).

        Raises:
            Exception: what the store raises, but a refusal of the condition.
        """
        if self.protocol not in _ATOMIC_CREATE:
            return f"{self.protocol}:// has no atomic create-if-absent"
        if self.protocol in ("file", "local"):
            return None
        probe = self.path(f".trl_ext-probe-{uuid.uuid4().hex}")
        try:
            self._create_if_absent(probe, b"1")
            if self._create_if_absent(probe, b"2"):
                return "the store ignores conditional writes (it let one file be created twice)"
            return None
        except OSError as exc:  # refused the condition itself (S3: 501 NotImplemented, 400 InvalidArgument)
            return f"the store refuses conditional writes ({first_line(exc)})"
        finally:
            with contextlib.suppress(Exception):
                self.fs.rm_file(probe)

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
        if self.protocol not in _S3:
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
    def on_retry(self, failed: Callable[[BaseException], None] | None) -> None:
        """Call ``failed(error)`` at each failed attempt of a request while the store's client retries it (S3:
        botocore's retries; other stores' clients retry without telling), so that the caller sees an outage at once
        and may end the retries by raising."""
        self._failed = failed
        self._watch()

    def _watch(self) -> None:
        if self._failed is not None and self.protocol in _S3 and self._watched is not self.fs.s3:
            self._watched = self.fs.s3  # s3fs makes a new client when its connection was closed: watch that one
            self._watched.meta.events.register("needs-retry.s3", self._attempted)

    def _attempted(self, caught_exception=None, response=None, **_) -> None:
        """botocore's ``needs-retry`` event, after every attempt: a failed one is told to ``_failed``. Returns None:
        whether and when to retry stays botocore's decision."""
        failed = self._failed
        if failed is None:
            return None
        if caught_exception is None:
            parsed = response[1] if response else {}
            status = parsed.get("ResponseMetadata", {}).get("HTTPStatusCode", 200)
            if status < 500 and status != 429:
                return None
            error = parsed.get("Error", {})
            caught_exception = ConnectionError(f"HTTP {status} {error.get('Code', '')}: {error.get('Message', '')}")
        failed(caught_exception)
        return None

    def upload(self, local: Path, rel: str, cancelled: Callable[[], bool] = lambda: False) -> tuple[int, str]:
        """Upload ``local`` to ``rel`` with the store's own ``put_file`` (S3: a multipart upload, ``PARTS_IN_FLIGHT``
        parts at a time, aborted when it fails), after hashing it as it is read here. A stopped upload ends after the
        part in flight.

        Returns:
            ``(size, checksum)`` of what was uploaded.

        Raises:
            MirrorError: ``local`` cannot be read (kind ``LOCAL_FILE``), or ``cancelled()`` became true (kind
                ``ABANDONED``). Anything the store raises once its client has retried.
        """
        size, digest = _hash(local, cancelled, rel)
        path = self.path(rel)
        kwargs = {}
        if self.protocol in _S3:
            kwargs = {"chunksize": UPLOAD_PART_BYTES, "max_concurrency": PARTS_IN_FLIGHT}
            self._watch()
        elif self.protocol in ("file", "local"):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            self.fs.put_file(str(local), path, callback=_Stop(cancelled, rel), **kwargs)
        except Exception as exc:
            if cancelled() and not isinstance(exc, MirrorError):
                # s3fs aborts a stopped multipart upload; an abort that botocore sent again after a slow answer finds
                # it gone already (NoSuchUpload, a FileNotFoundError): stopped all the same
                raise MirrorError(f"the upload of {rel} was stopped", kind=ABANDONED) from exc
            raise
        return size, digest

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


# the store clients' own exception modules: what they raise is the store's (the network, the server), not ours
_CLIENT_MODULES = ("botocore", "aiobotocore", "s3fs", "aiohttp", "urllib3", "requests", "httpx", "google", "gcsfs",
                   "azure", "adlfs", "huggingface_hub")


def is_store_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is the store's failure (a connection refused or reset, a timeout, a 5xx or throttling answer
    after its client's own retries, a refusal such as expired credentials), which a later attempt may get past, rather
    than an error in the code that called it (``RuntimeError``, ``AttributeError``...), which would only repeat.

    Args:
        exc: what a call to the store raised.

    Returns:
        True for the store's own kinds: ``OSError`` (connection errors, timeouts, and what s3fs translates S3's errors
        into) and the exceptions of the store clients' modules (botocore, aiohttp, gcsfs, azure...).
    """
    if isinstance(exc, OSError):
        return True
    return any(kind.__module__.split(".")[0] in _CLIENT_MODULES for kind in type(exc).__mro__)


def _hash(local: Path, cancelled: Callable[[], bool], rel: str) -> tuple[int, str]:
    """The size and checksum of the local file ``local``, read through once.

    Raises:
        MirrorError: it cannot be read (kind ``LOCAL_FILE``), or ``cancelled()`` became true (``ABANDONED``).
    """
    digest, size = manifest.hasher(), 0
    try:
        with open(local, "rb") as source:
            while chunk := source.read(READ_BYTES):
                if cancelled():
                    raise MirrorError(f"the upload of {rel} was stopped", kind=ABANDONED)
                digest.update(chunk)
                size += len(chunk)
    except OSError as exc:
        raise MirrorError(f"{local}: {first_line(exc)}", kind=LOCAL_FILE) from exc
    return size, digest.hexdigest()


class _Stop(Callback):
    """An upload's progress callback that ends it once ``cancelled()`` (s3fs then aborts its multipart upload)."""

    def __init__(self, cancelled: Callable[[], bool], rel: str):
        super().__init__()
        self.cancelled, self.rel = cancelled, rel

    def call(self, *args, **kwargs):
        if self.cancelled():
            raise MirrorError(f"the upload of {self.rel} was stopped", kind=ABANDONED)


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
