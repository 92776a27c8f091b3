"""Stream tensors into safetensors shards: plan the files from shapes alone, then write each tensor as it arrives.

Because every tensor's name, shape and dtype are known before any weight is gathered (``ds_shape`` under ZeRO-3),
each shard's header is written first and the tensors' bytes follow one by one. The writer never holds more than
the tensor it is given: no shard buffer, no consolidated state dict. The files are plain safetensors
(https://github.com/huggingface/safetensors#format), read by ``safe_open`` and ``from_pretrained``.
"""

import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.utils.hub import convert_file_size_to_int

from trl_ext.errors import CheckpointError
from trl_ext.files.header import encode_header

# Each tensor's first bytes are kept by the writer and compared with the file after the save. 4 KiB catches misplaced
# or unwritten data as well as more would; 64 KiB re-read most of a LoRA adapter (a quarter of its save time).
PREFIX_BYTES = 4 * 1024


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def parse_size(size: float | str) -> int | float:
    """``5GB``, ``500MB``, ``2GiB`` (transformers' own parser, as ``save_pretrained`` reads ``max_shard_size``), a
    number of bytes, or a number (``inf``: one file)."""
    if isinstance(size, (int, float)):
        return size
    return int(size) if size.strip().isdigit() else convert_file_size_to_int(size.strip())


def plan_shards(specs: list[TensorSpec], max_shard_size: int | str, prefix: str = "model",
                together: list[int] | None = None) -> dict[str, list[TensorSpec]]:
    """Split ``specs`` (kept in order) into files of at most ``max_shard_size`` bytes; a bigger tensor gets its own.

    File names follow transformers: ``model.safetensors`` for one file, ``model-00001-of-00003.safetensors`` else.
    ``together``: the sizes of consecutive runs of ``specs`` that must share a file (a converted unit's outputs,
    written by one rank); by default each tensor stands alone.
    """
    limit = parse_size(max_shard_size)
    runs, start = [], 0
    for length in together or [1] * len(specs):
        runs.append(specs[start : start + length])
        start += length
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for run in runs:
        nbytes = sum(spec.nbytes for spec in run)
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].extend(run)
        size += nbytes
    if len(groups) == 1:
        return {f"{prefix}.safetensors": groups[0]}
    n = len(groups)
    return {f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors": group for i, group in enumerate(groups)}


def index_json(plan: dict[str, list[TensorSpec]], metadata: dict | None = None) -> dict:
    """The ``model.safetensors.index.json`` content for a multi-file plan."""
    total = sum(spec.nbytes for specs in plan.values() for spec in specs)
    return {
        "metadata": {"total_size": total, **(metadata or {})},
        "weight_map": {spec.name: filename for filename, specs in plan.items() for spec in specs},
    }


@dataclass
class WrittenFile:
    """What the writer put in one file, kept for the check that re-reads it: the header bytes (length included) and
    each tensor's first ``PREFIX_BYTES``."""

    header: bytes = b""
    prefixes: dict[str, bytes] = field(default_factory=dict)


class ShardStreamWriter:
    """Writes the planned files in order; ``write`` must receive the tensors in plan order.

    ``written`` maps file name -> ``WrittenFile`` (its header and each tensor's first ``PREFIX_BYTES``), for the
    post-save check that re-reads them; at most 4 KiB per tensor are held. Each finished file is fsynced in a
    background thread while the next one is being written; ``wait`` (or ``close``) waits for all of them.
    """

    def __init__(self, directory: str | Path, plan: dict[str, list[TensorSpec]], metadata: dict | None = None):
        self.directory = Path(directory)
        self.metadata = {"format": "pt", **(metadata or {})}
        self._queue = [(filename, spec) for filename, specs in plan.items() for spec in specs]
        self._plan = plan
        self._position = 0
        self._file = None
        self._filename = None
        self._syncing: list[threading.Thread] = []
        self._sync_errors: list[OSError] = []
        self.written: dict[str, WrittenFile] = {filename: WrittenFile() for filename in plan}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one whole tensor."""
        spec = self.begin(name)
        if tuple(tensor.shape) != spec.shape:
            raise CheckpointError(
                f"{name}: got shape {tuple(tensor.shape)}, planned {spec.shape} "
                "(an ungathered ZeRO-3 placeholder has shape (0,))"
            )
        self.append(tensor)
        self.end()

    def begin(self, name: str) -> TensorSpec:
        """Start the next planned tensor; its bytes then arrive through ``append``, in order, and ``end`` closes it."""
        if self._position >= len(self._queue):
            raise CheckpointError(f"{name}: more tensors than planned")
        filename, spec = self._queue[self._position]
        if name != spec.name:
            raise CheckpointError(f"tensors arrive out of plan order: got {name}, expected {spec.name}")
        if filename != self._filename:
            self._close_file()
            self._file = open(self.directory / filename, "wb")
            self._filename = filename
            self.written[filename].header = encode_header(self._plan[filename], self.metadata)
            self._file.write(self.written[filename].header)
        self._written, self._prefix = 0, bytearray()
        return spec

    def append(self, piece: torch.Tensor) -> None:
        """Append the next part of the current tensor (flattened, row-major), e.g. one ZeRO-3 partition chunk."""
        spec = self._queue[self._position][1]
        if piece.dtype != spec.dtype:
            raise CheckpointError(f"{spec.name}: got {piece.dtype}, planned {spec.dtype}")
        data = memoryview(piece.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
        if self._written + len(data) > spec.nbytes:
            raise CheckpointError(f"{spec.name}: more bytes than its planned shape {spec.shape}")
        self._file.write(data)
        if self._written < PREFIX_BYTES:
            self._prefix += data[: PREFIX_BYTES - self._written]
        self._written += len(data)

    def end(self) -> None:
        filename, spec = self._queue[self._position]
        if self._written != spec.nbytes:
            raise CheckpointError(
                f"{spec.name}: {self._written} bytes written, its shape {spec.shape} needs {spec.nbytes} "
                "(an ungathered ZeRO-3 placeholder has shape (0,))"
            )
        self.written[filename].prefixes[spec.name] = bytes(self._prefix)
        self._position += 1

    def finish(self) -> None:
        """Close the last file; its fsync goes on in the background (``wait``). Raises if tensors are missing."""
        self._close_file()
        if self._position != len(self._queue):
            missing = [spec.name for _, spec in self._queue[self._position:]]
            raise CheckpointError(f"{len(missing)} planned tensors were never written, e.g. {missing[0]}")

    def wait(self) -> None:
        """Wait until every file is on disk; raises the first fsync error."""
        for thread in self._syncing:
            thread.join()
        if self._sync_errors:
            raise self._sync_errors[0]

    def close(self) -> None:
        """Finish the last file and wait until every file is on disk. Raises if tensors are missing."""
        self.finish()
        self.wait()

    def abort(self) -> None:
        """Stop after a failure: close the open file (its content is incomplete) and wait for pending syncs."""
        if self._file is not None:
            self._file.close()
            self._file = None
        for thread in self._syncing:
            thread.join()

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            thread = threading.Thread(target=self._sync_and_close, args=(self._file,), daemon=True)
            thread.start()  # on disk before the directory is committed by rename; overlaps the next file's writing
            self._syncing.append(thread)
            self._file = None

    def _sync_and_close(self, file) -> None:
        try:
            os.fsync(file.fileno())
        except OSError as exc:
            self._sync_errors.append(exc)
        finally:
            file.close()
