"""The files of a background checkpoint that Trainer, DeepSpeed and accelerate write themselves, copied in the
foreground and written on the saves' thread, unchanged.

Inside ``deferred_writes`` (around ``Trainer._save_checkpoint``, on the training thread only), ``torch.save(obj, path)``
(Trainer's optimizer, scheduler, scaler and RNG states; DeepSpeed's model and ZeRO optimizer states) and DCP's ``save``
(FSDP2's sharded optimizer states, as accelerate writes them) copy what they are given into the save's CPU buffers
(``snapshot``) and queue the write, with the same arguments, for the saves' thread. The files are those the libraries
write, byte for byte (DCP's ``.metadata`` aside: it records the writer's path and a random id, which differ between
two foreground saves too). Everything else these libraries do there (their collectives, ``latest``, DeepSpeed's
recovery scripts) runs as it always does.

Not the libraries' own asynchronous writers: DeepSpeed's decoupled checkpoint engine needs DeepSpeed's own launcher
(``CROSS_RANK``), moves the live training tensors to shared memory instead of copying them, cannot serialize ZeRO-2's
trimmed fp32 views and leaves a run's last checkpoint without ``latest``; DCP's ``async_save`` runs its collectives on
an executor thread of its own, which would interleave with the rest of the save on the same group.
"""

import contextlib
import functools
import os
import threading
from collections.abc import Callable

import torch

from trl_ext import patches
from trl_ext.errors import CheckpointError
from trl_ext.saving.snapshot import Snapshot
from trl_ext.saving.write import write_failed


def write_synced(write: Callable[[], None], path: str) -> CheckpointError | None:
    """One file written by ``write`` and synced to disk.

    Args:
        write: writes the file.
        path: the file, synced once written.

    Returns:
        The failure, or None.
    """
    try:
        write()
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks, not hang them
        return write_failed(path, exc)
    return None


def _write_dcp(save, state_dict, kwargs: dict) -> CheckpointError | None:
    try:
        save(state_dict, **kwargs)  # DCP syncs its files (FileSystemWriter's sync_files)
    except Exception as exc:  # noqa: BLE001 - DCP raises on every rank; any failure is agreed on, not left to hang
        return write_failed(os.fspath(kwargs["storage_writer"].path), exc)
    return None


@contextlib.contextmanager
def deferred_writes(saves, mode: str = "queue"):
    """Context: this thread's ``torch.save`` to a path and DCP's ``save`` copy their state into ``saves.snapshot``
    and queue the write on ``saves`` (patch ``deferred-checkpoint-files``).

    Args:
        saves: the ``BackgroundSaves`` collecting the checkpoint.
        mode: "queue" (copy and queue), "reserve" (copy only: the buffers are allocated, nothing is written) or
            "measure" (add the bytes a copy would take to ``saves.measured``, copy nothing).

    Yields:
        None.
    """
    import torch.distributed.checkpoint as dcp

    owner, torch_save, dcp_save = threading.get_ident(), torch.save, dcp.save

    def save(obj, f, *args, **kwargs):
        if threading.get_ident() != owner or not isinstance(f, (str, os.PathLike)):
            return torch_save(obj, f, *args, **kwargs)  # another thread, or a file object: as it was
        path = os.fspath(f)
        if mode == "measure":
            saves.measured += Snapshot.measure(obj)
            return None
        copied = saves.snapshot.copy(obj, key=os.path.basename(path))
        if mode == "queue":
            write = functools.partial(torch_save, copied, path, *args, **kwargs)  # a path: the bytes DeepSpeed writes
            saves.add(os.path.basename(path), functools.partial(write_synced, write, path))
        return None

    def save_dcp(state_dict, *args, **kwargs):
        writer = kwargs.get("storage_writer")
        if threading.get_ident() != owner or args or writer is None:
            return dcp_save(state_dict, *args, **kwargs)
        name = os.path.basename(os.fspath(writer.path))
        if mode == "measure":
            saves.measured += Snapshot.measure(state_dict)
            return None
        copied = saves.snapshot.copy(state_dict, key=f"dcp:{name}")
        if mode == "queue":
            saves.add(name, functools.partial(_write_dcp, dcp_save, copied,
                                              {**kwargs, "process_group": saves.group()}))
        return None

    with patches.swapped("deferred-checkpoint-files", torch, "save", save), \
            patches.swapped("deferred-checkpoint-files", dcp, "save", save_dcp):
        yield
