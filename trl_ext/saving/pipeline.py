"""The one save path, as a sequence of steps: plan, stage, stream the weights, verify, agree, commit.

Used by the trainers for the final save and for every intermediate checkpoint. ``save`` reads top to bottom: the
plan (``plan_weight_sets``: names, shapes and files, the same on every rank; ``split_for_writers`` and
``assign_files``: which rank writes which file), the staging directory with the configuration files (``_stage``, by
each copy's first rank), the weights streamed from ZeRO-3 partitions or FSDP2 shards to the rank that writes their
file (``_write_weights``, through ``gather.stream`` into ``shards.ShardStreamWriter``, so no rank holds the model, a
shard or a whole large tensor), each rank's files re-opened and checked (``_check_own_files``), then the directory as a
whole (``_check_directory``), every rank's outcome agreed (``_raise_if_any_failed``: a failure on one rank never
hangs the others), and the rename into place (``commit.commit``). Each step returns its error rather than raising, so
that every rank reaches the agreement.

Under ZeRO-3 and FSDP2 every rank writes: one copy of the checkpoint is shared by all ranks (storage every node
sees), or each node's ranks write that node's copy (node-local storage, ``save_on_each_node``).
"""

import contextlib
import copy
import functools
import json
import logging
import shutil
import time
from pathlib import Path

import torch
from accelerate.utils import is_peft_model

from trl_ext.errors import NONFINITE, CheckpointError
from trl_ext.saving import gather, hub_format, verify, written_check
from trl_ext.saving.background import BackgroundSaves
from trl_ext.saving.commit import PARTIAL_SUFFIX, commit
from trl_ext.saving.plan import (
    DEFAULT_MAX_SHARD_SIZE,
    assign_files,
    check_dtypes,
    plan_weight_sets,
    split_for_writers,
)
from trl_ext.saving.shards import ShardStreamWriter, TensorSpec, index_json

logger = logging.getLogger("trl_ext")

WRITE_FIX = ("nothing was committed and earlier saves are intact; free disk space or fix permissions there, then "
             "save again (or resume from the last checkpoint)")


class _Collect:
    """A sink that assembles each tensor whole (a conversion group's sources), on the writing rank. A failure is kept
    for later, never raised mid-transfer (the other ranks are still sending)."""

    def __init__(self, sources: list[tuple[str, torch.Tensor]], copy: bool):
        self.shapes = {n: gather.full_shape(t) for n, t in sources}
        self.copy, self.tensors, self.error = copy, {}, None  # copy: gathered parameters are released after the gather

    def begin(self, name):
        self.name, self.pieces = name, []

    def append(self, piece):
        self.pieces.append(piece)

    def end(self):
        try:
            pieces = self.pieces
            whole = torch.cat([p.reshape(-1) for p in pieces]) if self.copy or len(pieces) > 1 else pieces[0]
            self.tensors[self.name] = whole.view(self.shapes[self.name])
        except Exception as exc:  # noqa: BLE001 - reported by convert_and_write once the transfer is over
            self.error = self.error or exc

    def result(self) -> dict[str, torch.Tensor]:
        if self.error is not None:
            raise self.error
        return self.tensors


def _stream_units(model, units, sink, collective: bool, writer_rank: int | None, group=None) -> None:
    """Feed the units' outputs to ``sink`` in plan order: renamed tensors streamed in chunks, converted groups gathered
    whole (one at a time) and converted on the writing rank. Every rank calls it, as ``gather.stream``."""
    run: list[tuple[str, torch.Tensor]] = []  # consecutive streamed tensors, under their Hub names
    for unit in [*units, None]:
        if unit is not None and not unit.converted:
            run.append((unit.outputs[0].name, unit.sources[0][1]))
            continue
        if run:
            gather.stream(run, sink, collective, writer_rank, group)
            run = []
        if unit is None:
            continue
        whole = _Collect(unit.sources, copy=collective) if sink is not None else None
        gather.stream(unit.sources, whole, collective, writer_rank, group)
        if sink is not None:
            sink.convert_and_write(lambda: hub_format.to_hub(model, whole.result()), unit.outputs)


def _write_metadata(model, directory: Path, weight_sets, processing_class, training_args) -> None:
    """What ``from_pretrained`` needs beside the weights: configs, index, tokenizer, as save_pretrained writes them."""
    for ws in weight_sets:
        target = directory / ws.subdir
        if len(ws.plan) > 1:
            (target / "model.safetensors.index.json").write_text(json.dumps(index_json(ws.plan), indent=2))
        if ws.peft_config is not None:
            config = copy.deepcopy(ws.peft_config)
            base = model.get_base_model()
            config.base_model_name_or_path = config.base_model_name_or_path or getattr(base, "name_or_path", None)
            config.inference_mode = True
            for field in ("target_modules", "modules_to_save"):  # sets: written sorted, the same on every run
                if isinstance(getattr(config, field, None), set):
                    setattr(config, field, sorted(getattr(config, field)))
            auto_mapping = None
            if config.task_type is None:  # lets AutoPeftModel find the base class, as PEFT records it
                base_class = hub_format.model_class(base)
                auto_mapping = {"base_model_class": base_class.__name__, "parent_library": base_class.__module__}
            config.save_pretrained(str(target), auto_mapping_dict=auto_mapping)
    if is_peft_model(model):
        with contextlib.suppress(Exception):  # the model card is a nicety; never fail a save over it
            model.create_or_update_model_card(str(directory))
    else:
        config = copy.deepcopy(model.config)
        config.architectures = [hub_format.model_class(model).__name__]
        config.dtype = str(model.dtype).split(".")[1]
        if getattr(model, "_auto_class", None) is not None:  # remote code: copied beside it, as save_pretrained does
            from transformers.dynamic_module_utils import custom_object_save

            custom_object_save(model, str(directory), config=config)
        config.save_pretrained(str(directory))
        if model.can_generate() and model.generation_config is not None:
            model.generation_config.save_pretrained(str(directory))
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(str(directory))
    if training_args is not None:
        torch.save(training_args, directory / "training_args.bin")


class _Guarded:
    """Passes tensors to the writer until it fails once; then only records why. The writing rank must keep taking
    part in the collective transfers after a local failure (disk full, say), or the other ranks would hang."""

    def __init__(self, writer: ShardStreamWriter, error: str | None):
        self.writer, self.error = writer, error

    def _call(self, method, *args):
        if self.error is None:
            try:
                getattr(self.writer, method)(*args)
            except OSError as exc:  # disk full, permission denied, I/O error
                self.error = f"writing {self.writer.directory}: {exc}; {WRITE_FIX}"
            except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks, not hang them
                self.error = f"writing {self.writer.directory}: {type(exc).__name__}: {exc}"

    def convert_and_write(self, convert, outputs: list[TensorSpec]) -> None:
        """Write ``convert()``'s tensors in the planned order (``outputs``)."""
        if self.error is None:
            try:
                converted = convert()
            except Exception as exc:  # noqa: BLE001 - as above
                self.error = f"converting {[s.name for s in outputs][:2]} to the checkpoint layout: {exc}"
                return
            for spec in outputs:
                self._call("write", spec.name, converted[spec.name])

    def begin(self, name):
        self._call("begin", name)

    def append(self, piece):
        self._call("append", piece)

    def end(self):
        self._call("end")


def _ranks_where(flag: bool) -> list[int]:
    flags = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(flags, flag)
    return [rank for rank, f in enumerate(flags) if f]


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _errors_on_all_ranks(error: str | None, group=None) -> list[str]:
    """Every rank's error (None if fine), on every rank."""
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, error, group=group)
    return [e for e in everyone if e]


def _copies(leaders: list[int], world: int) -> list[list[int]]:
    """The ranks that write each copy of the checkpoint: all ranks for one copy; with one copy per node (each led by
    the node's first rank, as torchrun numbers ranks), each leader and the ranks after it up to the next leader."""
    bounds = [0, *leaders[1:], world]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(len(leaders))]


def save(model, output_dir: str, *, processing_class=None, training_args=None,
         max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, is_writer: bool | None = None,
         background: BackgroundSaves | None = None, held: bool = False) -> None:
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
        is_writer: whether this rank leads a copy of the checkpoint: stages it, writes its configuration files and
            commits it (default: ``training_args.should_save``, else rank 0).
        background: save in the background: this call returns once each rank has copied its own part of the weights
            to CPU memory, and ``background`` runs the rest (call it on every rank, each with its ``BackgroundSaves``;
            its ``wait`` reports the outcome). A model whose parts cannot be copied (NVMe offload, quantized
            partitions, 2-D meshes) is saved in the foreground.
        held: with ``background``, commit only once ``background.release`` is called.

    Raises:
        errors.CheckpointError: the save failed or its files failed verification; nothing was committed and the
            previous contents of ``output_dir`` are untouched. In the background: raised by ``background.wait``.
    """
    if is_writer is None:
        is_writer = training_args.should_save if training_args is not None else (
            not _distributed() or torch.distributed.get_rank() == 0)
    target = Path(output_dir).absolute()
    # Partitioned parameters need every rank at every transfer; whole ones are read by the writer alone.
    collective = _distributed() and any(gather.is_partitioned(p) for p in model.parameters())
    if not collective and not is_writer:
        if background is not None:  # it answers the step-boundary checks like the ranks that write
            background.mark_in_flight(str(target))
        return
    rank = torch.distributed.get_rank() if collective else 0
    key = (id(model), str(max_shard_size), is_writer, collective, tuple(id(p) for p in model.parameters()))
    layout = functools.partial(_layout, model, max_shard_size, is_writer, collective)
    copies, weight_sets, owners = background.layout(key, layout) if background is not None else layout()
    if not copies:  # no rank saves (the trainer's should_save is False everywhere)
        return
    mine = next(ranks for ranks in copies if rank in ranks)
    staging = target.with_name(f".{target.name}{PARTIAL_SUFFIX}")
    finish = functools.partial(_finish, model, target, staging, owners, copies, mine, rank, is_writer, collective,
                               time.monotonic(), processing_class, training_args)
    # Copies to CPU in the foreground; the same choice on every rank (the layout and the engine are the same)
    copied = background.copy(weight_sets) if background is not None else None
    if copied is None:
        if background is not None:
            background.say_foreground("some parameters are offloaded to NVMe, quantized or sharded over a 2-D mesh, "
                                      "whose parts cannot be copied")
        finish(weight_sets, None, commit)
        return
    group = background.group() if collective else None
    if held and is_writer:  # the caller writes the rest of the checkpoint there while the weights are written
        target.mkdir(parents=True, exist_ok=True)
    background.start(lambda: finish(copied, group, background.commit), str(target), held=held)


def _layout(model, max_shard_size, is_writer: bool, collective: bool):
    """Who writes which copy (``_copies``), what is written (the weight sets, split for the writers) and which rank
    writes each file: the same on every rank."""
    copies = _copies(_ranks_where(is_writer), torch.distributed.get_world_size()) if collective else [[0]]
    if not copies:
        return copies, [], []
    per_copy = min(len(ranks) for ranks in copies)  # the same plan on every rank, whatever its copy
    weight_sets = [split_for_writers(ws, per_copy, max_shard_size)
                   for ws in plan_weight_sets(model, max_shard_size)]
    check_dtypes(weight_sets)  # the same plan on every rank: all refuse together, with no collective call
    owners = [[assign_files(ws.plan, ranks) for ranks in copies] for ws in weight_sets]
    return copies, weight_sets, owners


def _finish(model, target: Path, staging: Path, owners, copies, mine, rank: int, is_writer: bool, collective: bool,
            started: float, processing_class, training_args, weight_sets, group, commit_with) -> None:
    """The save after its plan, on every rank (in the foreground, or on a background save's thread with a process
    group of its own): stage the directory, stream and write the weights, sync and check the files, agree, commit.
    Raises on every rank if any failed."""
    # Each step returns its error instead of raising: every rank must reach the agreement below, or others hang.
    error = _stage(model, target, staging, weight_sets, processing_class, training_args) if is_writer else None
    if collective:  # the other writers open files in the staging directory: it must exist, or all stop here
        everyone = _errors_on_all_ranks(error, group)  # a collective: every rank calls it
        error = error or "; ".join(dict.fromkeys(everyone)) or None
    writers = []
    if error is None:
        error, writers = _write_weights(model, staging, weight_sets, owners, copies.index(mine), rank, collective,
                                        group)
    error = error or _synced(writers, staging)
    unverified, checked = _check_own_files(target, staging, writers) if not error else (None, {})
    error = error or unverified
    if collective:  # every rank's files and their checks, on the rank that leads its copy
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, (error, checked), group=group)
        if is_writer and not error:
            error = next((everyone[r][0] for r in mine if everyone[r][0]), None)
            unverified = error if getattr(error, "kind", None) in ("verification", NONFINITE) else None
            checked = {}
            for r in mine:
                for subdir, (tensors, prefixes) in everyone[r][1].items():
                    checked.setdefault(subdir, ({}, {}))
                    checked[subdir][0].update(tensors)
                    checked[subdir][1].update(prefixes)
    if is_writer and not error:
        unverified = error = _check_directory(model, target, staging, weight_sets, checked)
    if is_writer and error and not unverified:  # files that failed verification are kept for inspection
        shutil.rmtree(staging, ignore_errors=True)
    _raise_if_any_failed(error, collective, group)
    if is_writer:
        commit_with(staging, target)
        logger.info(f"[trl_ext] saved and verified {target} in {time.monotonic() - started:.1f}s")
    if collective:
        torch.distributed.barrier(group=group)  # nobody reads the checkpoint before it is in place


def _stage(model, target: Path, staging: Path, weight_sets, processing_class, training_args) -> str | None:
    """A copy's first rank: an empty staging directory beside ``target``, with the configuration files. Returns the
    error."""
    try:
        shutil.rmtree(staging, ignore_errors=True)  # left by an interrupted save
        for ws in weight_sets:
            (staging / ws.subdir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {staging}: {exc}; {WRITE_FIX}"
    total = sum(s.nbytes for ws in weight_sets for specs in ws.plan.values() for s in specs)
    logger.info(f"[trl_ext] saving {total / 2**20:.1f} MiB to {target}")
    try:  # first, so that the checks run while the last weight file's fsync is still going on
        _write_metadata(model, staging, weight_sets, processing_class, training_args)
    except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks, not hang them
        return f"writing the configuration files: {type(exc).__name__}: {exc}"
    return None


def _units_by_file(ws) -> dict[str, list]:
    """Each planned file's units, in plan order (a unit's outputs share a file)."""
    file_of = {spec.name: filename for filename, specs in ws.plan.items() for spec in specs}
    by_file = {filename: [] for filename in ws.plan}
    for unit in ws.units:
        by_file[file_of[unit.outputs[0].name]].append(unit)
    return by_file


def _write_weights(model, staging: Path, weight_sets, owners, copy_index: int, rank: int,
                   collective: bool, group=None) -> tuple[str | None, list[tuple[ShardStreamWriter, dict]]]:
    """Every rank: each file's tensors streamed to the rank that writes it (with one copy, only to that rank; with a
    copy per node, gathered whole by each node's writer). A writer that already failed keeps taking part, writing
    nothing. Returns the error and this rank's file writers with their plans, still syncing."""
    error, writers = None, []
    for ws, ws_owners in zip(weight_sets, owners):
        files = {f: specs for f, specs in ws.plan.items() if ws_owners[copy_index][f] == rank}
        writer = ShardStreamWriter(staging / ws.subdir, files) if files else None
        sink = _Guarded(writer, error) if writer is not None else None
        for filename, units in _units_by_file(ws).items():
            writer_rank = ws_owners[0][filename] if len(ws_owners) == 1 else None
            _stream_units(model, units, sink if filename in files else None, collective, writer_rank, group)
        if sink is None:
            continue
        writers.append((writer, files))
        error = sink.error
        if error is None:
            try:
                writer.finish()  # the last file's fsync goes on during the checks
            except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks, not hang them
                error = str(exc)
        else:
            writer.abort()
    return error, writers


def _check_own_files(target: Path, staging: Path, writers) -> tuple[str | None, dict]:
    """The files this rank wrote, re-opened and checked against the plan. Returns the error, and per weight-set
    directory each tensor's ``(shape, dtype)`` and first bytes, for the directory's check."""
    problems, checked = [], {}
    for writer, files in writers:
        try:
            found = written_check.check_files(writer.directory, files, writer.written)
        except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks, not hang them
            found = ([f"the checks themselves failed: {type(exc).__name__}: {exc}"], {}, {})
        problems += found[0]
        checked[str(writer.directory.relative_to(staging))] = found[1:]
    return (_unverified(target, staging, problems) if problems else None), checked


def _check_directory(model, target: Path, staging: Path, weight_sets, checked: dict) -> str | None:
    """A copy's first rank, once every file passed its writer's check: each directory as a whole, against the plan
    and the trained model (``checked``: every file's tensors, per directory). Returns the error."""
    config = model.get_base_model().config if is_peft_model(model) else model.config
    problems = []
    try:
        for ws in weight_sets:
            tensors, prefixes = checked.get(str((staging / ws.subdir).relative_to(staging)), ({}, {}))
            problems += written_check.check_directory(str(staging / ws.subdir), ws.plan, tensors, prefixes,
                                                      ws.peft_config, getattr(config, "num_labels", 1))
    except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks, not hang them
        problems = [f"the checks themselves failed: {type(exc).__name__}: {exc}"]
    return _unverified(target, staging, problems) if problems else None


def _unverified(target: Path, staging: Path, problems: list) -> verify.Problem:
    diverged = [p for p in problems if getattr(p, "kind", None) == NONFINITE]  # NaN or inf: training diverged
    return verify.Problem(f"the checkpoint for {target} failed verification; nothing was committed and the previous "
                          f"contents are untouched. The files are kept in {staging} for inspection.\n  "
                          + "\n  ".join(problems), kind=NONFINITE if diverged else "verification",
                          detail=diverged[0] if diverged else None)


def _synced(writers, staging: Path) -> str | None:
    """Every file on disk (or its fsync error) before anything is committed or removed."""
    error = None
    for writer, _ in writers:
        try:
            writer.wait()
        except OSError as exc:
            error = error or f"syncing {staging} to disk: {exc}; {WRITE_FIX}"
    return error


def _raise_if_any_failed(error: str | None, collective: bool, group=None) -> None:
    """Raise on every rank if any rank failed (one collective call when the save was collective)."""
    failures = _errors_on_all_ranks(error, group) if collective else [error] if error else []
    if failures:
        diverged = [f for f in failures if getattr(f, "kind", None) == NONFINITE]  # a Problem keeps its kind
        raise CheckpointError("saving failed: " + "\n".join(dict.fromkeys(failures)),
                              kind=NONFINITE if diverged else "save", detail=diverged[0].detail if diverged else None)


def supports(model) -> bool:
    """Models this save path writes: transformers models and PEFT models around them."""
    from transformers import PreTrainedModel

    return is_peft_model(model) or isinstance(model, PreTrainedModel)
