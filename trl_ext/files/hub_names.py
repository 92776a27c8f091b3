"""The Hub's own tensor layout for a full model: what transformers' ``save_pretrained`` writes, planned from shapes.

transformers 5 converts some weights on load (MoE experts fused into one tensor, vision-language prefixes renamed)
and reverts them on save with ``core_model_loading.revert_weight_conversion``. We run that same function, first on
meta tensors, to learn every output name, shape and dtype before any weight moves, and to split the model into
units: a tensor that is only renamed (streamed in chunks as before), or a group of tensors that one conversion turns
into others (one module's experts, say), gathered whole and converted on the writing rank. No table of ours: the
conversions are the model's own (``_weight_conversions``, or transformers' mapping for its type).
"""

from dataclasses import dataclass

import torch

from trl_ext import patches
from trl_ext.engines.sharded import full_shape
from trl_ext.errors import PlanError
from trl_ext.files.shards import TensorSpec


@dataclass
class Unit:
    """Tensors written together: ``sources`` (in-memory names and live tensors) become ``outputs`` (Hub names).

    ``converted`` is False for a tensor that is at most renamed: its bytes are streamed unchanged under
    ``outputs[0].name``. A converted unit is gathered whole and passed through ``to_hub``.
    """

    sources: list[tuple[str, torch.Tensor]]
    outputs: list[TensorSpec]
    converted: bool = False


def model_class(model) -> type:
    """The class ``save_pretrained`` names in ``config.json``'s ``architectures``: the model's own, not the
    ``FSDP<Class>`` subclass that FSDP2's ``fully_shard`` swaps in. Serving engines pick the class by that name.

    Args:
        model: a transformers model, possibly sharded by FSDP2.

    Returns:
        The first class in the model's MRO that is not an FSDP2 wrapper.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return type(model)
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def _meta(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: torch.empty(full_shape(t), dtype=t.dtype, device="meta") for name, t in tensors}


def _revert(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    keep_used_weight_conversions(model)  # under ZeRO-3 transformers keeps unused ones
    return revert_weight_conversion(model, dict(tensors))


def _specs(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]


def _module(name: str) -> str:
    return name.rpartition(".")[0]


def plan(model, tensors: list[tuple[str, torch.Tensor]]) -> list[Unit]:
    """Split ``tensors`` (``state_dict`` names of ``model``, live or partitioned) into units in Hub layout.

    Args:
        model: The transformers model the tensors belong to (its conversions decide the layout).
        tensors: ``(name, tensor)`` pairs in the order to write them; ZeRO-3 placeholders count with ``ds_shape``.

    Returns:
        Units in writing order; their outputs together are exactly what ``save_pretrained`` would write.

    Raises:
        PlanError: when the conversions cannot be split into groups that are reverted on their own.
    """
    meta = _meta(tensors)
    whole = _revert(model, meta)
    if not _differs(whole, meta):  # nothing converted: every tensor streams under its own name
        return [Unit([(n, t)], [TensorSpec(n, full_shape(t), t.dtype)]) for n, t in tensors]

    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in tensors:  # conversions act within one module (its experts, its projections)
        groups.setdefault(_module(name), []).append((name, tensor))
    units = []
    for name, tensor in tensors:
        group = groups.get(_module(name))
        if group is None:
            continue  # this module's group is already planned
        out = _revert(model, _meta(group))
        singles = [_revert(model, _meta([item])) for item in group] if len(out) == len(group) else []
        if singles and all(len(single) == 1 and next(iter(single.values())).shape == meta[item[0]].shape
                           for item, single in zip(group, singles)):  # every tensor at most renamed
            for item, single in zip(group, singles):
                (hub_name, hub), = single.items()
                units.append(Unit([item], [TensorSpec(hub_name, tuple(hub.shape), hub.dtype)]))
        else:
            units.append(Unit(group, _specs(out), converted=True))
        del groups[_module(name)]

    planned = {s.name: (s.shape, s.dtype) for u in units for s in u.outputs}
    expected = {n: (tuple(t.shape), t.dtype) for n, t in whole.items()}
    if planned != expected:
        differ = sorted(set(planned).symmetric_difference(expected))[:3]
        raise PlanError(f"cannot plan {type(model).__name__}'s checkpoint layout module by module (transformers' "
                         f"conversions span modules; e.g. {differ}): save it with save_pretrained instead")
    return units


def to_hub(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Convert whole tensors (in-memory names) to the Hub layout with transformers' own reverse conversions.

    Args:
        model: The transformers model the tensors belong to.
        tensors: One or more complete conversion groups (for example all of one module's tensors).

    Returns:
        Hub names mapped to tensors, as ``save_pretrained`` would write them.
    """
    return _revert(model, tensors)


def is_converted(model) -> bool:
    """True when ``save_pretrained`` writes ``model`` under other names or layouts than its ``state_dict``."""
    meta = _meta(list(model.state_dict(keep_vars=True).items()))
    return _differs(_revert(model, meta), meta)


def _differs(reverted: dict[str, torch.Tensor], meta: dict[str, torch.Tensor]) -> bool:
    return set(reverted) != set(meta) or any(reverted[n].shape != meta[n].shape for n in meta)


def keep_used_weight_conversions(model) -> None:
    """Keep only the weight conversions that matched the checkpoint, as ``from_pretrained`` does outside ZeRO-3
    (patch ``unused-weight-conversions``). Fixing the model also fixes the user's own ``save_pretrained``."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions and patches.applies("unused-weight-conversions") and not all(c.was_used() for c in conversions):
        model._weight_conversions = [c for c in conversions if c.was_used()]
