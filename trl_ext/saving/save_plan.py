"""What a save writes, decided before anything is written and the same on every rank: the weight sets (the adapters
of a PEFT model, or the full model in the Hub's layout), their tensors under the names they are saved with, the files
they go to and which rank writes each (``Layout``); and one save as an object (``Save``), carried through the
pipeline's steps from the plan to the commit, in the foreground or on the executor's thread."""

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from accelerate.utils import is_peft_model

from trl_ext import patches
from trl_ext.engines.sharded import full_shape, state_tensors
from trl_ext.errors import CheckpointError
from trl_ext.files import hub_names
from trl_ext.files.commit import PARTIAL_SUFFIX, commit
from trl_ext.files.header import DTYPE_CODES
from trl_ext.files.shards import TensorSpec, parse_size, plan_shards
from trl_ext.settings.trainer_options import SaveOptions

logger = logging.getLogger("trl_ext")

DEFAULT_MAX_SHARD_SIZE = SaveOptions.max_shard_size  # the config's default, for saves outside a trainer


@dataclass
class WeightSet:
    """One directory's weights: the adapter (PEFT) or the full model (Hub layout), in writing order."""

    subdir: str
    units: list[hub_names.Unit]
    plan: dict[str, list[TensorSpec]]
    peft_config: object = None


def _adapter_weight_sets(model) -> list[WeightSet]:
    """PEFT's own key mapping (``get_peft_model_state_dict``) applied to the live tensors: canonical keys, no adapter
    name, ``modules_to_save`` under the plain module name. One set per adapter, laid out as PEFT does."""
    from peft import get_peft_model_state_dict

    live, wrapper = model.state_dict(keep_vars=True), checkpoint_wrapper_prefix() or ""
    if wrapper and any(wrapper in name for name, _ in model.named_modules()):
        # Activation-checkpoint wrappers (FSDP's fsdp_activation_checkpointing) strip their prefix from state_dict
        # keys but not from module names, and PEFT finds adapter weights by module name: it would drop every LoRA
        # weight. Map with the module names, write without the wrapper's prefix.
        live = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    sets = []
    for adapter, config in model.peft_config.items():
        mapped = {name.replace(wrapper, "") if wrapper else name: tensor for name, tensor in
                  get_peft_model_state_dict(model, state_dict=live, adapter_name=adapter).items()}
        # PEFT's keys are what PeftModel.from_pretrained takes: no conversion (PEFT's own save reverts none either)
        units = [hub_names.Unit([(n, t)], [TensorSpec(n, full_shape(t), t.dtype)]) for n, t in mapped.items()]
        plan = plan_shards([u.outputs[0] for u in units], float("inf"), prefix="adapter_model")  # PEFT reads one file
        sets.append(WeightSet("" if adapter == "default" else adapter, units, plan, config))
    return sets


def _file_plan(units: list[hub_names.Unit], max_shard_size) -> dict[str, list[TensorSpec]]:
    """Files of at most ``max_shard_size``; a converted unit's outputs share a file (one rank converts and writes)."""
    return plan_shards([s for u in units for s in u.outputs], max_shard_size,
                       together=[len(u.outputs) for u in units])


def _full_weight_set(model, max_shard_size) -> WeightSet:
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or [])
    tensors = [(n, t) for n, t in state_tensors(model).items() if n not in ignored]
    units = hub_names.plan(model, tensors)  # the names, shapes and layout save_pretrained writes
    return WeightSet("", units, _file_plan(units, max_shard_size))


def plan_weight_sets(model, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> list[WeightSet]:
    """What a save of ``model`` writes: its adapters (PEFT), or the full model in the Hub's layout.

    Args:
        model: a transformers model or a PEFT model around one, possibly ZeRO-3 or FSDP2 sharded.
        max_shard_size: the largest safetensors file of a full model (adapters are one file, as PEFT reads them).

    Returns:
        One ``WeightSet`` per directory written, each with its units (live tensors -> Hub names) and file plan.
    """
    return _adapter_weight_sets(model) if is_peft_model(model) else [_full_weight_set(model, max_shard_size)]


def check_dtypes(weight_sets: list[WeightSet]) -> None:
    """Refuse, on every rank and before anything is written, a dtype the safetensors format cannot hold.

    Args:
        weight_sets: the plan, from ``plan_weight_sets``.

    Raises:
        CheckpointError: a tensor's dtype has no safetensors code.
    """
    unknown = sorted({str(s.dtype) for ws in weight_sets for specs in ws.plan.values() for s in specs
                      if s.dtype not in DTYPE_CODES})
    if unknown:
        raise CheckpointError(f"saving failed: safetensors cannot store {', '.join(unknown)}; nothing was "
                                     "written. Cast those tensors to a supported dtype (e.g. model.to(torch.float32)) "
                                     "before saving.")


# Files smaller than this are not split further for more writers: below it, opening and syncing a file costs more than
# the bytes it takes from the busiest writer.
MIN_PARALLEL_SHARD_SIZE = 256 * 2**20
FILES_PER_WRITER = 4  # with the largest file at most a quarter of a writer's share, the busiest writes <= 1.25x


def split_for_writers(ws: WeightSet, writers: int, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                      min_shard_size: int = MIN_PARALLEL_SHARD_SIZE) -> WeightSet:
    """``ws`` with files small enough that ``writers`` ranks share the writing evenly.

    Shard boundaries may differ from one save to another, as ``max_shard_size`` allows: the names, shapes, dtypes and
    metadata stay what ``save_pretrained`` writes. An adapter stays one file (PEFT reads one), so one rank writes it.

    Args:
        ws: a weight set from ``plan_weight_sets``.
        writers: the ranks that write this replica of the checkpoint.
        max_shard_size: the user's largest file; files are never larger.
        min_shard_size: files are not made smaller than this to add writers (bytes).

    Returns:
        The weight set with its file plan recomputed (``ws`` itself when nothing changes).
    """
    if ws.peft_config is not None or writers <= 1:
        return ws
    total = sum(s.nbytes for specs in ws.plan.values() for s in specs)
    limit = min(parse_size(max_shard_size), max(total / (FILES_PER_WRITER * writers), min_shard_size))
    return WeightSet(ws.subdir, ws.units, _file_plan(ws.units, limit), ws.peft_config)


def assign_files(plan: dict[str, list[TensorSpec]], ranks: list[int]) -> dict[str, int]:
    """Each file to one of ``ranks``, balanced by bytes: largest file first, to the rank with the fewest bytes so far
    (ties to the lowest rank). The same on every rank, from the plan alone.

    Args:
        plan: file name -> its tensors.
        ranks: the writing ranks of one replica of the checkpoint.

    Returns:
        file name -> the rank that writes it.
    """
    load = {rank: 0 for rank in ranks}
    owner = {}
    sizes = {f: sum(s.nbytes for s in specs) for f, specs in plan.items()}
    for filename in sorted(plan, key=lambda f: (-sizes[f], f)):
        rank = min(ranks, key=lambda r: (load[r], r))
        owner[filename] = rank
        load[rank] += sizes[filename]
    return owner


@dataclass(frozen=True)
class Layout:
    """Who writes what, the same on every rank, planned once per model (``pipeline.plan_layout``).

    Args:
        replicas: the ranks that write each replica of the checkpoint (one replica, or one per node), each led by its
            first.
        weight_sets: what is written (``WeightSet``: the adapters, or the full model in the Hub's layout).
        owners: per weight set, per replica, file name -> the rank that writes it.
    """

    replicas: list[list[int]]
    weight_sets: list
    owners: list[list[dict[str, int]]]


@dataclass
class Save:
    """One save of ``model`` to ``target``.

    Args:
        model: the model saved (its config and conversions; its tensors are read through ``weight_sets``).
        target: the directory committed at the end.
        layout: who writes what (``Layout``).
        rank: this rank (0 when the save is not collective).
        is_writer: this rank leads its replica: creates its partial directory, writes the configuration files, checks
            and commits it.
        collective: partitioned parameters: every rank takes part in every transfer and agreement.
        processing_class: the tokenizer or processor saved beside the weights (or None).
        training_args: saved as ``training_args.bin`` (or None).
        weight_sets: what the ranks stream: the layout's, with live tensors, or a background save's CPU copies.
        group: the process group of the transfers and agreements (None: the default one).
        started: when the save started (``time.monotonic()``), for its log line.
    """

    model: object
    target: Path
    layout: Layout
    rank: int
    is_writer: bool
    collective: bool
    processing_class: object = None
    training_args: object = None
    weight_sets: list = field(default_factory=list)
    group: object = None
    started: float = field(default_factory=time.monotonic)

    @property
    def partial(self) -> Path:
        """Where the files are written and checked before the commit: beside ``target``, hidden."""
        return self.target.with_name(f".{self.target.name}{PARTIAL_SUFFIX}")

    @property
    def mine(self) -> list[int]:
        """The ranks that write this rank's replica of the checkpoint."""
        return next(ranks for ranks in self.layout.replicas if self.rank in ranks)

    @property
    def replica_index(self) -> int:
        return self.layout.replicas.index(self.mine)

    def commit_save(self) -> None:
        """The checked partial directory renamed into place, on the replica's first rank (the others: nothing)."""
        if self.is_writer:
            commit(self.partial, self.target)
            logger.info(f"[trl_ext] saved and verified {self.target} in {time.monotonic() - self.started:.1f}s")

    def on(self, weight_sets: list, group=None) -> "Save":
        """The same save, streaming ``weight_sets`` (a background checkpoint's copies) over ``group``."""
        return replace(self, weight_sets=weight_sets, group=group)


def checkpoint_wrapper_prefix() -> str | None:
    """The prefix torch's ``CheckpointWrapper`` adds to the names of the modules it wraps (patch
    ``checkpoint-wrapper``), or None where the release moved it."""
    if not patches.applies("checkpoint-wrapper"):
        return None
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    return _CHECKPOINT_PREFIX
