"""The files of a background checkpoint that Trainer, DeepSpeed and accelerate write themselves, staged on the
training thread and written on the executor's thread, unchanged.

Inside ``deferred_writes`` (around ``Trainer._save_checkpoint``, on the training thread only), ``torch.save(obj, path)``
(Trainer's optimizer, scheduler, scaler and RNG states; DeepSpeed's model and ZeRO optimizer states) and DCP's ``save``
(FSDP2's sharded optimizer states, as accelerate writes them) stage what they are given in the checkpoint's CPU
buffers (``BackgroundCheckpoint.stage``) and queue the write, with the same arguments, for the executor's thread. The
files are those the libraries write, byte for byte (DCP's ``.metadata`` aside: it records the writer's path and a
random id, which differ between two foreground saves too). Everything else these libraries do there (their
collectives, ``latest``, DeepSpeed's recovery scripts) runs as it always does.

Not the libraries' own asynchronous writers: DeepSpeed's decoupled checkpoint engine needs DeepSpeed's own launcher
(``CROSS_RANK``), moves the live training tensors to shared memory instead of copying them, cannot serialize ZeRO-2's
trimmed fp32 views and leaves a run's last checkpoint without ``latest``; DCP's ``async_save`` runs its collectives on
a thread of its own, which would interleave with the rest of the checkpoint's collectives on the same group.
"""

import contextlib
import functools
import os
import threading
from collections.abc import Callable

import torch

from trl_ext import patches
from trl_ext.errors import CheckpointError
from trl_ext.files.commit import fsync
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
        fsync(path)
    except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks, not hang them
        return write_failed(path, exc)
    return None


def _write_dcp(dcp_save, state_dict, kwargs: dict) -> CheckpointError | None:
    try:
        dcp_save(state_dict, **kwargs)  # DCP syncs its files (FileSystemWriter's sync_files)
    except Exception as exc:  # noqa: BLE001 - DCP raises on every rank; any failure is agreed on, not left to hang
        return write_failed(os.fspath(kwargs["storage_writer"].path), exc)
    return None


def _plan_cached(planner):
    """DCP's default save planner with its plan caching on (``enable_plan_caching``): the optimizer states' layout is
    the same at every checkpoint, so the ranks send their plans once instead of at every checkpoint. Any other planner
    is kept as it is."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    if planner is None:
        return DefaultSavePlanner(enable_plan_caching=True)
    if type(planner) is not DefaultSavePlanner:
        return planner
    return DefaultSavePlanner(flatten_state_dict=planner.flatten_state_dict,
                              flatten_sharded_tensors=planner.flatten_sharded_tensors,
                              dedup_save_to_lowest_rank=planner.dedup_save_to_lowest_rank, enable_plan_caching=True)


@contextlib.contextmanager
def deferred_writes(checkpoint):
    """Context: this thread's ``torch.save`` to a path and DCP's ``save`` give what they would write to
    ``checkpoint`` (an ``executor.BackgroundCheckpoint``: staged and queued, copied at once for a reserve, or
    measured) instead of writing it (patch ``deferred-checkpoint-files``).

    Args:
        checkpoint: the checkpoint being collected.

    Yields:
        None.
    """
    import torch.distributed.checkpoint as dcp

    owner, torch_save, dcp_save = threading.get_ident(), torch.save, dcp.save

    def save_file(obj, f, *args, **kwargs):
        if threading.get_ident() != owner or not isinstance(f, (str, os.PathLike)):
            return torch_save(obj, f, *args, **kwargs)  # another thread, or a file object: as it was
        path = os.fspath(f)
        copied = checkpoint.stage(obj, key=os.path.basename(path))
        write = functools.partial(torch_save, copied, path, *args, **kwargs)  # a path: the bytes DeepSpeed writes
        checkpoint.add(os.path.basename(path), functools.partial(write_synced, write, path))
        return None

    def save_dcp(state_dict, *args, **kwargs):
        writer = kwargs.get("storage_writer")
        if threading.get_ident() != owner or args or writer is None:
            return dcp_save(state_dict, *args, **kwargs)
        name = os.path.basename(os.fspath(writer.path))
        copied = checkpoint.stage(state_dict, key=f"dcp:{name}")
        kwargs = {**kwargs, "planner": _plan_cached(kwargs.get("planner")), "process_group": checkpoint.group()}
        checkpoint.add(name, functools.partial(_write_dcp, dcp_save, copied, kwargs))
        return None

    with patches.swapped("deferred-checkpoint-files", torch, "save", save_file), \
            patches.swapped("deferred-checkpoint-files", dcp, "save", save_dcp):
        yield
