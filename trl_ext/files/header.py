"""The safetensors header (https://github.com/huggingface/safetensors#format), written and read in one place: by the
streaming writer (``shards``), by the checks that re-read what it wrote (``audit``, ``readback``), and by the lazy
reader (``reader``).

An 8-byte little-endian length, then a JSON object mapping each tensor's name to its dtype code, shape and
``data_offsets`` (relative to the data section), plus ``__metadata__``. ``read`` checks what ``safe_open`` checks
(sizes match shapes, offsets contiguous, nothing truncated) without mapping the file.
"""

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from trl_ext.errors import UnreadableCheckpoint

# Every dtype safetensors writes (its ``safetensors.torch._TYPES``; a unit test keeps the two equal).
DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.bool: "BOOL", torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}
ITEM_BITS = {code: dtype.itemsize * 8 for dtype, code in DTYPE_CODES.items()}  # other codes: size not checked


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its shape and dtype code, and where its bytes lie (absolute offsets in the file)."""

    shape: list[int]
    code: str
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A parsed header: the tensors in data order, and the file's ``__metadata__``."""

    entries: dict[str, Entry]
    metadata: dict[str, str]


def encode_header(specs, metadata: dict[str, str]) -> bytes:
    """The header bytes (length included) for tensors written in ``specs`` order.

    Args:
        specs: the tensors' ``TensorSpec`` (name, shape, dtype), in the order their bytes follow.
        metadata: the file's ``__metadata__`` (``{"format": "pt"}`` for transformers).

    Returns:
        The bytes that start the file; the data section after them is 8-byte aligned.
    """
    entries, offset = {"__metadata__": metadata}, 0
    for spec in specs:
        entries[spec.name] = {"dtype": DTYPE_CODES[spec.dtype], "shape": list(spec.shape),
                              "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def read_header(fd: int) -> Header:
    """Parse and check the header of the open safetensors file ``fd`` (positioned reads; the file is not mapped).

    Args:
        fd: an open file descriptor.

    Returns:
        The ``Header``, its entries in data order with absolute offsets.

    Raises:
        UnreadableCheckpoint: the file is not valid safetensors (short, truncated, sizes or offsets that do not
            add up); ValueError for bad JSON, KeyError or TypeError for an entry without its fields.
    """
    size = os.fstat(fd).st_size
    if size < 8:
        raise UnreadableCheckpoint(f"{size} bytes, shorter than a safetensors header")
    (claimed,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if claimed > size - 8:
        raise UnreadableCheckpoint(f"the header claims {claimed} bytes, the file holds {size - 8}")
    return parse(os.pread(fd, claimed, 8), size)


def length(first8: bytes, size: int) -> int:
    """The header's length from a file's first 8 bytes, checked against the file's ``size`` (a file read remotely).

    Raises:
        UnreadableCheckpoint: a file too short, or a length it cannot hold.
    """
    if size < 8 or len(first8) < 8:
        raise UnreadableCheckpoint(f"{size} bytes, shorter than a safetensors header")
    (claimed,) = struct.unpack("<Q", first8[:8])
    if claimed > size - 8:
        raise UnreadableCheckpoint(f"the header claims {claimed} bytes, the file holds {size - 8}")
    return claimed


def parse(raw_header: bytes, size: int) -> Header:
    """Parse and check a header's JSON bytes (those after the 8-byte length) for a file of ``size`` bytes: what
    ``read`` checks, for bytes read from anywhere (an object store, say).

    Args:
        raw_header: the header's bytes.
        size: the whole file's size.

    Returns:
        The ``Header``.

    Raises:
        UnreadableCheckpoint, ValueError, KeyError, TypeError: as ``read``.
    """
    raw = json.loads(raw_header)
    metadata = raw.pop("__metadata__", None) or {}
    start, spans = 8 + len(raw_header), []
    for name, entry in raw.items():
        shape, code, (begin, end) = list(entry["shape"]), entry["dtype"], entry["data_offsets"]
        bits = ITEM_BITS.get(code)
        if bits is not None and (end - begin) * 8 != math.prod(shape) * bits:
            raise UnreadableCheckpoint(f"{name}: {end - begin} bytes for a {code} tensor of shape {shape}")
        spans.append((begin, end, name, shape, code))
    spans.sort()
    position = 0
    for begin, end, name, _, _ in spans:
        if begin != position:
            raise UnreadableCheckpoint(f"{name}: its data starts at byte {begin}, the previous tensor ends at "
                                       f"{position}")
        position = end
    if position != size - start:
        raise UnreadableCheckpoint(f"the tensors need {position} bytes of data, the file holds {size - start} "
                                   "(truncated?)")
    entries = {name: Entry(shape, code, start + begin, start + end) for begin, end, name, shape, code in spans}
    return Header(entries, metadata)
