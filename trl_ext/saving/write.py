"""A save's files written. Beside the weights, what ``from_pretrained`` and serving engines read, as ``save_pretrained``
writes it (``write_metadata``): the index, the model's config (its own class in ``architectures``, not FSDP2's
wrapper) and generation config, or the adapter's config; the tokenizer or processor; the training arguments.

The weights are streamed into their files: every rank sends its parts of each file's tensors to the rank that writes
that file (``gather.stream``), which writes them as they arrive (``files.shards.ShardStreamWriter``), so no rank holds
the model, a shard or a whole large tensor. A tensor that transformers converts on save (fused MoE experts, say) is
gathered whole with its conversion group, converted on the writing rank and written.

A rank that fails while writing (disk full, say) keeps taking part in the transfers, writing nothing: the other ranks
would otherwise wait for it forever. Its error is returned, never raised mid-transfer.
"""

import contextlib
import copy
import json
import shutil
from pathlib import Path

import torch
from accelerate.utils import is_peft_model

from trl_ext.engines.sharded import full_shape
from trl_ext.errors import CheckpointError
from trl_ext.files import hub_names
from trl_ext.files.shards import ShardStreamWriter, TensorSpec, index_json
from trl_ext.saving import gather
from trl_ext.saving.save_plan import Save

WRITE_FIX = ("nothing was committed and earlier saves are intact; free disk space or fix permissions there, then "
             "save again (or resume from the last checkpoint)")


LOW_DISK_BYTES = 1 << 30  # below this, a failed write says how much room its disk has left


def failed(message: str) -> CheckpointError:
    """A save step's failure, as every rank raises it once the ranks agree."""
    return CheckpointError(f"saving failed: {message}", kind="save")


def write_failed(where: str, exc: BaseException) -> CheckpointError:
    """A failed write, said for people: an ``OSError`` with what to do, any other error with its class, and either
    way the free space of the disk holding ``where`` when it is nearly full (a full disk reaches some writers, DCP's
    among them, as an error that does not say so).

    Args:
        where: the file or directory being written.
        exc: what the write raised.

    Returns:
        The error every rank raises once the ranks agree.
    """
    detail = f"{exc}; {WRITE_FIX}" if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
    path = Path(where)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        free = None
    low = f" (the disk holding {where} has {free / 2**20:.0f} MiB free)" if free is not None and free < LOW_DISK_BYTES \
        else ""
    return failed(f"writing {where}: {detail}{low}")


def _adapter_config(model, peft_config):
    config = copy.deepcopy(peft_config)
    base = model.get_base_model()
    config.base_model_name_or_path = config.base_model_name_or_path or getattr(base, "name_or_path", None)
    config.inference_mode = True
    for field in ("target_modules", "modules_to_save"):  # sets: written sorted, the same on every run
        if isinstance(getattr(config, field, None), set):
            setattr(config, field, sorted(getattr(config, field)))
    auto_mapping = None
    if config.task_type is None:  # lets AutoPeftModel find the base class, as PEFT records it
        base_class = hub_names.model_class(base)
        auto_mapping = {"base_model_class": base_class.__name__, "parent_library": base_class.__module__}
    return config, auto_mapping


def write_metadata(model, directory: Path, weight_sets, processing_class=None, training_args=None) -> None:
    """Write everything but the weights into ``directory``.

    Args:
        model: the model saved (a transformers model or a PEFT model around one, possibly sharded).
        directory: the save's partial directory.
        weight_sets: the save's plan (``save_plan.WeightSet``s): an index for each set of several files, an adapter
            config for each adapter.
        processing_class: a tokenizer or processor to save beside the weights (optional).
        training_args: saved as ``training_args.bin`` (optional).
    """
    for ws in weight_sets:
        target = directory / ws.subdir
        if len(ws.plan) > 1:
            (target / "model.safetensors.index.json").write_text(json.dumps(index_json(ws.plan), indent=2))
        if ws.peft_config is not None:
            config, auto_mapping = _adapter_config(model, ws.peft_config)
            config.save_pretrained(str(target), auto_mapping_dict=auto_mapping)
    if is_peft_model(model):
        with contextlib.suppress(Exception):  # the model card is a nicety; never fail a save over it
            model.create_or_update_model_card(str(directory))
    else:
        config = copy.deepcopy(model.config)
        config.architectures = [hub_names.model_class(model).__name__]
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


class _Collect:
    """A sink that assembles each tensor whole (a conversion group's sources), on the writing rank. A failure is kept
    for later, never raised mid-transfer (the other ranks are still sending)."""

    def __init__(self, sources: list[tuple[str, torch.Tensor]], copy: bool):
        self.shapes = {n: full_shape(t) for n, t in sources}
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


class _Guarded:
    """Passes tensors to the writer until it fails once; then only records why. The writing rank must keep taking
    part in the collective transfers after a local failure (disk full, say), or the other ranks would hang."""

    def __init__(self, writer: ShardStreamWriter, error: CheckpointError | None):
        self.writer, self.error = writer, error

    def _call(self, method, *args):
        if self.error is None:
            try:
                getattr(self.writer, method)(*args)
            except Exception as exc:  # noqa: BLE001 - any failure (disk full, say) must reach the other ranks
                self.error = write_failed(str(self.writer.directory), exc)

    def convert_and_write(self, convert, outputs: list[TensorSpec]) -> None:
        """Write ``convert()``'s tensors in the planned order (``outputs``)."""
        if self.error is None:
            try:
                converted = convert()
            except Exception as exc:  # noqa: BLE001 - as above
                self.error = failed(f"converting {[s.name for s in outputs][:2]} to the checkpoint layout: {exc}")
                return
            for spec in outputs:
                self._call("write", spec.name, converted[spec.name])

    def begin(self, name):
        self._call("begin", name)

    def append(self, piece):
        self._call("append", piece)

    def end(self):
        self._call("end")


def _stream_units(save: Save, units, sink, writer_rank: int | None) -> None:
    """Feed the units' outputs to ``sink`` in plan order: renamed tensors streamed in chunks, converted groups gathered
    whole (one at a time) and converted on the writing rank. Every rank calls it, as ``gather.stream``."""
    run: list[tuple[str, torch.Tensor]] = []  # consecutive streamed tensors, under their Hub names
    for unit in [*units, None]:
        if unit is not None and not unit.converted:
            run.append((unit.outputs[0].name, unit.sources[0][1]))
            continue
        if run:
            gather.stream(run, sink, save.collective, writer_rank, save.group)
            run = []
        if unit is None:
            continue
        whole = _Collect(unit.sources, copy=save.collective) if sink is not None else None
        gather.stream(unit.sources, whole, save.collective, writer_rank, save.group)
        if sink is not None:
            sink.convert_and_write(lambda: hub_names.to_hub(save.model, whole.result()), unit.outputs)


def _units_by_file(ws) -> dict[str, list]:
    """Each planned file's units, in plan order (a unit's outputs share a file)."""
    file_of = {spec.name: filename for filename, specs in ws.plan.items() for spec in specs}
    by_file = {filename: [] for filename in ws.plan}
    for unit in ws.units:
        by_file[file_of[unit.outputs[0].name]].append(unit)
    return by_file


def write_weights(save: Save) -> tuple[CheckpointError | None, list[tuple[ShardStreamWriter, dict]]]:
    """Every rank: each file's tensors streamed to the rank that writes it (with one replica, only to that rank; with a
    replica per node, gathered whole by each node's writer). A writer that already failed keeps taking part, writing
    nothing.

    Args:
        save: the save.

    Returns:
        The error (None if fine) and this rank's file writers with their plans, still syncing.
    """
    error, writers = None, []
    for ws, ws_owners in zip(save.weight_sets, save.layout.owners):
        files = {f: specs for f, specs in ws.plan.items() if ws_owners[save.replica_index][f] == save.rank}
        writer = ShardStreamWriter(save.partial / ws.subdir, files) if files else None
        sink = _Guarded(writer, error) if writer is not None else None
        for filename, units in _units_by_file(ws).items():
            writer_rank = ws_owners[0][filename] if len(ws_owners) == 1 else None
            _stream_units(save, units, sink if filename in files else None, writer_rank)
        if sink is None:
            continue
        writers.append((writer, files))
        error = sink.error
        if error is None:
            try:
                writer.finish()  # the last file's fsync goes on during the checks
            except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks, not hang them
                error = failed(str(exc))
        else:
            writer.abort()
    return error, writers


def synced(writers, partial: Path) -> CheckpointError | None:
    """Every file on disk (or its fsync error) before anything is committed or removed."""
    error = None
    for writer, _ in writers:
        try:
            writer.wait()
        except OSError as exc:
            error = error or failed(f"syncing {partial} to disk: {exc}; {WRITE_FIX}")
    return error
