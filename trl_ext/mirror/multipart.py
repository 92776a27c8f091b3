"""An S3 upload whose parts go up several at a time, as s3fs's own ``put_file`` sends them, while the file's checksum is
computed on the bytes as they are read: a file-like upload (``fs.open(..., "wb")``) sends its parts one after
another, and ``put_file`` reads the file itself, so neither gives both. A failed or stopped upload is aborted (S3
keeps, and bills, the parts of one that is not).
"""

import asyncio
import math
from collections.abc import Callable

from fsspec.asyn import sync

from trl_ext.errors import ABANDONED, LOCAL_FILE, MirrorError

PARTS_IN_FLIGHT = 4
MIN_PART_BYTES = 16 * 2**20  # S3's minimum is 5 MiB; fewer, larger requests cost less
MAX_PARTS = 9000  # S3 allows 10,000


def part_bytes(size: int) -> int:
    """The part size for a file of ``size`` bytes: ``MIN_PART_BYTES``, or larger so that it needs at most
    ``MAX_PARTS`` parts."""
    return max(MIN_PART_BYTES, math.ceil(size / MAX_PARTS / 2**20) * 2**20)


def read_chunk(source, size: int, digest, cancelled: Callable[[], bool], what: str) -> bytes:
    """The next ``size`` bytes (fewer at the end) of the open local file ``source``, added to ``digest``: one step of
    an upload, which a stopped transfer ends first.

    Args:
        source: The local file, open for reading in binary.
        size: How many bytes to read.
        digest: The checksum being computed (``manifest.hasher()``).
        cancelled: Whether the transfer was stopped.
        what: The file's remote name, for the message.

    Returns:
        The bytes read (empty at the end of the file).

    Raises:
        MirrorError: ``cancelled()`` became true (kind ``ABANDONED``) or reading failed (``LOCAL_FILE``).
    """
    if cancelled():
        raise MirrorError(f"the upload of {what} was stopped", kind=ABANDONED)
    try:
        chunk = source.read(size)
    except OSError as exc:
        raise MirrorError(f"{source.name}: {exc}", kind=LOCAL_FILE) from exc
    digest.update(chunk)
    return chunk


def upload(fs, path: str, source, size: int, digest, cancelled: Callable[[], bool]) -> int:
    """Upload the open file ``source`` (``size`` bytes) to ``path`` (``bucket/key``) with s3fs's client, updating
    ``digest`` with every byte read, in order.

    Returns:
        The bytes uploaded.

    Raises:
        MirrorError: reading ``source`` failed (kind ``LOCAL_FILE``) or ``cancelled()`` became true (``ABANDONED``);
            anything the store raises.
    """
    bucket, key, _ = fs.split_path(path)
    part = part_bytes(size)

    def read() -> bytes:
        return read_chunk(source, part, digest, cancelled, path)

    first = read()
    if len(first) < part:  # one request
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=first)
        fs.invalidate_cache(path)
        return len(first)
    upload_id = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]

    async def send(number: int, body: bytes) -> dict:
        answer = await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                   Body=body)
        checksums = {name: value for name, value in answer.items()  # the part's own checksum, if the client sent one:
                     if name.startswith("Checksum") and name != "ChecksumType"}  # S3 then needs it to complete
        return {"PartNumber": number, "ETag": answer["ETag"], **checksums}

    async def sends(first_number: int, bodies: list[bytes]) -> list[dict]:
        return await asyncio.gather(*(send(first_number + i, body) for i, body in enumerate(bodies)))

    try:
        parts, sent, chunk = [], 0, first
        while chunk:
            bodies = [chunk]
            while len(bodies) < PARTS_IN_FLIGHT and (chunk := read()):
                bodies.append(chunk)
            parts += sync(fs.loop, sends, len(parts) + 1, bodies)
            sent += sum(len(body) for body in bodies)
            chunk = read() if len(bodies) == PARTS_IN_FLIGHT else b""
        fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                   MultipartUpload={"Parts": parts})
    except BaseException:
        try:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception:  # noqa: BLE001 - the store may be the reason: its lifecycle rules expire the parts
            pass
        raise
    fs.invalidate_cache(path)
    return sent
