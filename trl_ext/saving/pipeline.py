"""The one save path: plan, write the weights, check, agree, commit.

Used by the trainers for the final save and for every checkpoint's weights. ``save`` plans the layout once per model
(``plan_layout``: the weight sets, which rank writes which file of which replica) and makes the save a ``Save``;
``run`` then reads top to bottom, on every rank:

1. ``_create_partial``: the replica's first rank creates the partial directory beside the target, with the configuration
   files;
2. ``write.write_weights``: the weights streamed from ZeRO-3 partitions or FSDP2 shards to the rank that writes their
   file, which writes them as they arrive, then fsyncs them (``write.synced``);
3. ``_check_own_files``: each rank re-reads its own files against what it wrote (``files.readback``);
4. ``_check_directory``: the replica's first rank checks the directory as a whole (``files.audit``);
5. ``errors.agree``: every rank learns every rank's outcome; a failure is raised on all of them, with its kind;
6. the commit: the partial directory renamed into place (``files.commit``).

Each step returns its error instead of raising, so that every rank reaches the agreement: a failure on one rank never
hangs the others. Under ZeRO-3 and FSDP2 every rank writes: one replica of the checkpoint is shared by all ranks
(storage every node sees), or each node's ranks write that node's replica (node-local storage, ``save_on_each_node``).
In a background checkpoint (``into``, an ``executor.BackgroundCheckpoint``), steps 1-6 run on the executor's thread,
on each rank's CPU copy of its parts.
"""

import dataclasses
import logging
import shutil
from pathlib import Path

import torch
from accelerate.utils import is_peft_model

from trl_ext import errors
from trl_ext.engines.sharded import LocalCopy, is_partitioned, local_copy
from trl_ext.errors import NONFINITE, VERIFICATION, CheckpointError
from trl_ext.files import readback
from trl_ext.process.collectives import from_every_rank
from trl_ext.process.ranks import distributed
from trl_ext.saving import write
from trl_ext.saving.executor import BackgroundCheckpoint
from trl_ext.saving.save_plan import (
    DEFAULT_MAX_SHARD_SIZE,
    Layout,
    Save,
    assign_files,
    check_dtypes,
    plan_weight_sets,
    split_for_writers,
)
from trl_ext.saving.write import write_metadata

logger = logging.getLogger("trl_ext")


def _ranks_where(flag: bool) -> list[int]:
    return [rank for rank, f in enumerate(from_every_rank(flag)) if f]


def _replicas(leaders: list[int], world: int) -> list[list[int]]:
    """The ranks that write each replica of the checkpoint: all ranks for one replica; with one replica per node (each
    led by the node's first rank, as torchrun numbers ranks), each leader and the ranks after it up to the next
    leader."""
    bounds = [0, *leaders[1:], world]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(len(leaders))]


def plan_layout(model, max_shard_size, is_writer: bool, collective: bool) -> Layout:
    """Who writes which replica, what is written (the weight sets, split for the writers) and which rank writes each
    file: the same on every rank (a collective when ``collective``).

    Raises:
        CheckpointError: a dtype safetensors cannot store, on every rank, before anything is written.
    """
    replicas = _replicas(_ranks_where(is_writer), torch.distributed.get_world_size()) if collective else [[0]]
    if not replicas:
        return Layout([], [], [])
    per_replica = min(len(ranks) for ranks in replicas)  # the same plan on every rank, whatever its replica
    weight_sets = [split_for_writers(ws, per_replica, max_shard_size)
                   for ws in plan_weight_sets(model, max_shard_size)]
    check_dtypes(weight_sets)  # the same plan on every rank: all refuse together, with no collective call
    owners = [[assign_files(ws.plan, ranks) for ranks in replicas] for ws in weight_sets]
    return Layout(replicas, weight_sets, owners)


def save(model, output_dir: str, *, processing_class=None, training_args=None,
         max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, is_writer: bool | None = None,
         into: BackgroundCheckpoint | None = None) -> None:
    """Save ``model`` (a transformers model or a PEFT model, possibly ZeRO-3 or FSDP2 sharded) to ``output_dir``.

    PEFT models are written as the adapter only (``adapter_model.safetensors`` + ``adapter_config.json``); other
    models as sharded safetensors with an index, in the Hub's layout. Under ZeRO-3 and FSDP2 call it on every rank:
    every rank writes some of the files (balanced by bytes), receiving only the partitions of the tensors in its own
    files, and every rank raises if any of them failed. With whole parameters (DDP, ZeRO-1/2, one process) only the
    writing rank does anything, with no collective call, so a save guarded by ``if trainer.is_world_process_zero()``
    works as it does with transformers.

    Args:
        model: the model to save.
        output_dir: the directory to create or replace; written beside it first and renamed into place once verified.
        processing_class: a tokenizer or processor to save with the weights (optional).
        training_args: the run's ``TrainingArguments``, saved as ``training_args.bin``; its ``should_save`` picks the
            writing rank when ``is_writer`` is None.
        max_shard_size: the largest safetensors file of a full model, as in ``save_pretrained``. Under ZeRO-3 and
            FSDP2 files may be smaller, so that every rank has some to write (``split_for_writers``).
        is_writer: whether this rank leads a replica of the checkpoint: creates its partial directory, writes its
            configuration files and commits it (default: ``training_args.should_save``, else rank 0).
        into: a checkpoint written in the background (``executor.BackgroundCheckpoint``, on every rank): this call
            returns once each rank has staged its own part of the weights, which the checkpoint writes with its other
            parts. A model whose parts cannot be copied (NVMe offload, quantized partitions, 2-D meshes) is saved in
            the foreground, said once.

    Raises:
        errors.CheckpointError: the save failed or its files failed verification; nothing was committed and the
            previous contents of ``output_dir`` are untouched. In the background: raised on every rank at the next
            step boundary after the write.
    """
    if is_writer is None:
        is_writer = training_args.should_save if training_args is not None else (
            not distributed() or torch.distributed.get_rank() == 0)
    target = Path(output_dir).absolute()
    collective, layout = _planned(model, max_shard_size, is_writer, into)
    if layout is None or not layout.replicas:  # this rank takes no part, or no rank saves (no should_save)
        return
    planned = Save(model, target, layout, torch.distributed.get_rank() if collective else 0, is_writer, collective,
                     processing_class, training_args, weight_sets=layout.weight_sets)
    if into is not None:
        # the same choice on every rank: it depends on the engine's settings, not on the rank
        copied = stage_weights(layout.weight_sets, into)
        if copied is not None:
            if is_writer:  # the caller writes the rest of the checkpoint there while the weights are written
                target.mkdir(parents=True, exist_ok=True)
            planned = planned.on(copied, into.group() if collective else None)
            into.add(target.name, lambda: write_and_check(planned), commit=planned.commit_save if is_writer else None)
            return
        into.say_foreground(CANNOT_COPY)
    run(planned)


CANNOT_COPY = ("some parameters are offloaded to NVMe, quantized or sharded over a 2-D mesh, whose parts cannot be "
               "copied")


def stage_weights(weight_sets, into: BackgroundCheckpoint):
    """The weight sets with each source replaced by this rank's CPU copy of it (``engines.sharded.local_copy``: its
    own part of a partitioned tensor, or the whole tensor), staged in ``into``'s snapshot: copied while training goes
    on, or measured. None if some source cannot be copied (the same on every rank: it depends on the engine's
    settings).

    Args:
        weight_sets: the layout's weight sets (live tensors).
        into: the checkpoint the copies belong to (or a reserve, or a measure).

    Returns:
        The weight sets around the copies, or None.
    """
    copied = []
    for ws in weight_sets:
        units = []
        for unit in ws.units:
            sources = []
            for name, tensor in unit.sources:
                copy = local_copy(tensor, lambda part: into.stage(part, "weights"))
                if copy is None:
                    return None
                part = copy.part if isinstance(copy, LocalCopy) else copy
                into.weight_bytes += part.numel() * part.element_size()
                sources.append((name, copy))
            units.append(dataclasses.replace(unit, sources=sources))
        copied.append(dataclasses.replace(ws, units=units))
    return copied


def reserve_weights(model, max_shard_size, is_writer: bool, into: BackgroundCheckpoint) -> int | None:
    """The CPU copy a background checkpoint's weights take on this rank, planned (the layout ``save`` reuses) and
    staged in ``into`` (a reserve: allocated and filled once; or a measure). Call on every rank, at the same point
    (planning is collective).

    Args:
        model: the model the background checkpoints will write.
        max_shard_size: as for ``save``.
        is_writer: as for ``save``.
        into: a ``BackgroundCheckpoint`` for ``Purpose.RESERVE`` or ``Purpose.MEASURE``.

    Returns:
        Bytes of this rank's copy of the weights, or None when some parts cannot be copied (checkpoints then go to the
        foreground).
    """
    _, layout = _planned(model, max_shard_size, is_writer, into)
    if layout is None:
        return 0
    return None if stage_weights(layout.weight_sets, into) is None else into.weight_bytes


def _planned(model, max_shard_size, is_writer: bool, into: BackgroundCheckpoint | None):
    """Whether the save is collective, and its layout: planned once and kept by the executor (``save`` and
    ``reserve_weights`` find the same one), or planned now; None when this rank takes no part (whole parameters, not the
    writer)."""
    # Partitioned parameters need every rank at every transfer; whole ones are read by the writer alone.
    collective = distributed() and any(is_partitioned(p) for p in model.parameters())
    if not collective and not is_writer:
        return collective, None

    def plan():
        return plan_layout(model, max_shard_size, is_writer, collective)

    if into is None:
        return collective, plan()
    key = (id(model), str(max_shard_size), is_writer, collective, tuple(id(p) for p in model.parameters()))
    return collective, into.layout(key, plan)


def run(save: Save) -> None:
    """The save after its plan, in the foreground, on every rank: ``write_and_check``, then every rank's outcome
    agreed on and the commit.

    Raises:
        CheckpointError: on every rank, if any rank failed; nothing was committed.
    """
    error = write_and_check(save)
    if save.collective:
        errors.agree(error, save.group, prefer=(NONFINITE,))
    elif error is not None:
        raise error
    save.commit_save()
    if save.collective:
        torch.distributed.barrier(group=save.group)  # nobody reads the checkpoint before it is in place


def write_and_check(save: Save) -> CheckpointError | None:
    """Create the partial directory, stream and write the weights, sync and check the files, on every rank that takes
    part (in the foreground, or on the executor's thread with a process group of its own). Collective when the save
    is.

    Returns:
        This rank's failure (the replica's first rank: its replica's), or None; the files of a failed save are removed,
        except those that failed verification (kept for inspection).
    """
    error = _create_partial(save) if save.is_writer else None
    if save.collective:  # the other writers open files in the partial directory: it must exist, or all stop here
        error = errors.across_ranks(error, save.group)
    writers = []
    if error is None:
        error, writers = write.write_weights(save)
    error = error or write.synced(writers, save.partial)
    checked = {}
    if error is None:
        error, checked = _check_own_files(save, writers)
    if save.collective:  # every rank's files and their checks, on the rank that leads its replica
        error, checked = _collect_checks(save, error, checked)
    if save.is_writer and error is None:
        error = _check_directory(save, checked)
    if save.is_writer and error is not None and error.kind not in (VERIFICATION, NONFINITE):
        shutil.rmtree(save.partial, ignore_errors=True)  # files that failed verification are kept for inspection
    return error


def _create_partial(save: Save) -> CheckpointError | None:
    """A replica's first rank: an empty partial directory beside the target, with the configuration files."""
    try:
        shutil.rmtree(save.partial, ignore_errors=True)  # left by an interrupted save
        for ws in save.weight_sets:
            (save.partial / ws.subdir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return write.failed(f"cannot create {save.partial}: {exc}; {write.WRITE_FIX}")
    total = sum(s.nbytes for ws in save.weight_sets for specs in ws.plan.values() for s in specs)
    logger.info(f"[trl_ext] saving {total / 2**20:.1f} MiB to {save.target}")
    try:  # first, so that the checks run while the last weight file's fsync is still going on
        write_metadata(save.model, save.partial, save.weight_sets, save.processing_class, save.training_args)
    except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks, not hang them
        return write.failed(f"writing the configuration files: {type(exc).__name__}: {exc}")
    return None


def _check_own_files(save: Save, writers) -> tuple[CheckpointError | None, dict]:
    """The files this rank wrote, re-opened and checked against the plan. Returns the error, and per weight-set
    directory each tensor's ``(shape, dtype)`` and first bytes, for the directory's check."""
    problems, checked = [], {}
    for writer, files in writers:
        try:
            found = readback.check_files(writer.directory, files, writer.written)
        except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks, not hang them
            found = ([f"the checks themselves failed: {type(exc).__name__}: {exc}"], {}, {})
        problems += found[0]
        checked[str(writer.directory.relative_to(save.partial))] = found[1:]
    return (_unverified(save, problems) if problems else None), checked


def _collect_checks(save: Save, error: CheckpointError | None, checked: dict) -> tuple[CheckpointError | None,
                                                                                        dict]:
    """Every rank's outcome and checks, on every rank; the replica's first rank keeps its replica's (the others keep
    theirs)."""
    everyone = from_every_rank((error, checked), group=save.group)
    if not save.is_writer or error is not None:
        return error, checked
    error = next((everyone[r][0] for r in save.mine if everyone[r][0] is not None), None)
    merged = {}
    for r in save.mine:
        for subdir, (tensors, prefixes) in everyone[r][1].items():
            merged.setdefault(subdir, ({}, {}))
            merged[subdir][0].update(tensors)
            merged[subdir][1].update(prefixes)
    return error, merged


def _check_directory(save: Save, checked: dict) -> CheckpointError | None:
    """A replica's first rank, once every file passed its writer's check: each directory as a whole, against the plan
    and the trained model (``checked``: every file's tensors, per directory)."""
    config = save.model.get_base_model().config if is_peft_model(save.model) else save.model.config
    problems = []
    try:
        for ws in save.weight_sets:
            directory = save.partial / ws.subdir
            tensors, prefixes = checked.get(str(directory.relative_to(save.partial)), ({}, {}))
            problems += readback.check_directory(str(directory), ws.plan, tensors, prefixes, ws.peft_config,
                                                 getattr(config, "num_labels", 1))
    except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks, not hang them
        problems = [f"the checks themselves failed: {type(exc).__name__}: {exc}"]
    return _unverified(save, problems) if problems else None


def _unverified(save: Save, problems: list) -> CheckpointError:
    diverged = [p for p in problems if getattr(p, "kind", None) == NONFINITE]  # NaN or inf: training diverged
    return CheckpointError(f"saving failed: the checkpoint for {save.target} failed verification; nothing was "
                           f"committed and the previous contents are untouched. The files are kept in {save.partial} "
                           "for inspection.\n  " + "\n  ".join(problems),
                           kind=NONFINITE if diverged else VERIFICATION, detail=diverged[0] if diverged else None)


def supports(model) -> bool:
    """Models this save path writes: transformers models and PEFT models around them."""
    from transformers import PreTrainedModel

    # The cheap test first: accelerate's asks importlib.metadata whether PEFT is installed at every call, and a trainer
    # asks at every checkpoint.
    return isinstance(model, PreTrainedModel) or is_peft_model(model)
