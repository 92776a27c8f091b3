"""Checkpoint tensor names and in-memory names, related through transformers' own weight-conversion mapping.

transformers 5 renames checkpoint tensors on load (Qwen2-VL's Hub ``model.layers.0...`` is
``model.language_model.layers.0...`` in memory; LLaVA's ``language_model.model...`` is ``model.language_model...``)
and fuses some (MoE experts), and reverts both on save. PEFT adapters are keyed by the in-memory names. We ask
transformers for both directions, on a model instantiated on the meta device, instead of keeping string rules.
"""

from dataclasses import dataclass

import torch

from trl_ext.errors import PlanError


@dataclass(frozen=True)
class Loaded:
    """Where ``from_pretrained`` would put one checkpoint tensor."""

    memory_name: str
    fused: bool  # one of several checkpoint tensors that a converter combines (e.g. per-expert weights)


def checkpoint_to_memory(model: torch.nn.Module, checkpoint_names: list[str]) -> dict[str, Loaded]:
    """Map each checkpoint tensor name to the parameter or buffer ``from_pretrained`` would load it into.

    The same steps as ``transformers.core_model_loading.convert_and_load_state_dict_in_model``: the model's
    conversion mapping (legacy checkpoint layouts included), then the base-model prefix added or removed.

    Args:
        model: a transformers model, typically on the meta device.
        checkpoint_names: the names in the checkpoint's safetensors headers.

    Returns:
        ``{checkpoint name: Loaded}`` for every name the model has a place for; other names are left out (what
        ``from_pretrained`` reports as unexpected keys, e.g. ``lm_head.weight`` for a sequence classifier).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    in_memory = model.state_dict()
    prefix = model.base_model_prefix
    loaded = {}
    for name in checkpoint_names:
        renamed, pattern = rename_source_key(name, renamings, converters, prefix, in_memory)
        if renamed not in in_memory and name in in_memory:  # as from_pretrained: a name that needed no renaming
            renamed, pattern = rename_source_key(name, [], [], base_model_prefix=prefix, meta_state_dict=in_memory)
        if renamed in in_memory:
            loaded[name] = Loaded(renamed, fused=pattern is not None)
    return loaded


def saved_name(model: torch.nn.Module, memory_name: str) -> str:
    """The name ``save_pretrained`` gives the in-memory tensor ``memory_name`` (through
    ``transformers.core_model_loading.revert_weight_conversion``), for tensors the base checkpoint does not have:
    a new classification head, an output embedding that was tied."""
    from transformers.core_model_loading import revert_weight_conversion

    tensor = model.state_dict(keep_vars=True)[memory_name]
    reverted = revert_weight_conversion(model, {memory_name: tensor})
    if len(reverted) != 1:  # a fused tensor: saved as several; never asked for here
        raise PlanError(f"{memory_name} is saved as {len(reverted)} tensors")
    return next(iter(reverted))
