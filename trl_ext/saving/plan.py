"""What a save writes, decided before anything is written and the same on every rank: the weight sets (the adapters
of a PEFT model, or the full model in the Hub's layout), their tensors under the names they are saved with, and the
files they go to."""

from dataclasses import dataclass

from accelerate.utils import is_peft_model
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

from trl_ext.errors import CheckpointError
from trl_ext.saving import gather, hub_format
from trl_ext.saving.safetensors_header import DTYPE_CODES
from trl_ext.saving.shards import TensorSpec, plan_shards

DEFAULT_MAX_SHARD_SIZE = "50GB"  # transformers' default


@dataclass
class WeightSet:
    """One directory's weights: the adapter (PEFT) or the full model (Hub layout), in writing order."""

    subdir: str
    units: list[hub_format.Unit]
    plan: dict[str, list[TensorSpec]]
    peft_config: object = None


def _adapter_weight_sets(model) -> list[WeightSet]:
    """PEFT's own key mapping (``get_peft_model_state_dict``) applied to the live tensors: canonical keys, no adapter
    name, ``modules_to_save`` under the plain module name. One set per adapter, laid out as PEFT does."""
    from peft import get_peft_model_state_dict

    live, wrapper = model.state_dict(keep_vars=True), _CHECKPOINT_PREFIX
    if any(wrapper in name for name, _ in model.named_modules()):
        # Activation-checkpoint wrappers (FSDP's fsdp_activation_checkpointing) strip their prefix from state_dict
        # keys but not from module names, and PEFT finds adapter weights by module name: it would drop every LoRA
        # weight. Map with the module names, write without the wrapper's prefix.
        live = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    sets = []
    for adapter, config in model.peft_config.items():
        mapped = {name.replace(wrapper, ""): tensor for name, tensor in
                  get_peft_model_state_dict(model, state_dict=live, adapter_name=adapter).items()}
        # PEFT's keys are what PeftModel.from_pretrained takes: no conversion (PEFT's own save reverts none either)
        units = [hub_format.Unit([(n, t)], [TensorSpec(n, gather.full_shape(t), t.dtype)]) for n, t in mapped.items()]
        plan = plan_shards([u.outputs[0] for u in units], float("inf"), prefix="adapter_model")  # PEFT reads one file
        sets.append(WeightSet("" if adapter == "default" else adapter, units, plan, config))
    return sets


def _full_weight_set(model, max_shard_size) -> WeightSet:
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or [])
    tensors = [(n, t) for n, t in gather.state_tensors(model).items() if n not in ignored]
    units = hub_format.plan(model, tensors)  # the names, shapes and layout save_pretrained writes
    return WeightSet("", units, plan_shards([s for u in units for s in u.outputs], max_shard_size))


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
