"""``iter_merged_weights(model)``: the merged weights of a model being trained, in the Hub's own layout, one module
at a time (gathered under ZeRO-3, unsharded under FSDP2), without merging the model: for pushing weights into vLLM
and the like (the GRPO/RLOO weight sync)."""

from collections.abc import Iterator

import torch
from accelerate.utils import is_peft_model

from trl_ext.engines import sharded
from trl_ext.errors import MergeError
from trl_ext.files import hub_names


def iter_merged_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the merged weights of a model in the Hub's own layout, one module at a time, for serving engines.

    The names and layout are those ``save_pretrained`` writes for the merged model (what vLLM's ``load_weights``
    takes): no ``base_model.model.``, ``.base_layer``, ``lora_*`` or ``modules_to_save.<adapter>``, and weights that
    transformers converts on load (fused MoE experts, renamed vision-language prefixes) converted back with its own
    reverse conversions. Tied weights are yielded once, under the name ``save_pretrained`` keeps.

    Args:
        model: A PEFT model (LoRA adapters are merged on the fly; the model itself is not modified) or a plain
            transformers model. Under ZeRO-3 each module is gathered on every rank in turn, so call it on every rank.

    Yields:
        ``(name, tensor)`` pairs; each tensor is a new tensor the caller may keep.

    Raises:
        MergeError: for DoRA adapters (``trl_ext.merge.merge`` handles them).
    """
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    base = model.get_base_model() if is_peft_model(model) else model
    units = sharded.FsdpUnits(model)  # FSDP2: each module is read with its unit's parameters unsharded
    done: list[str] = []  # prefixes of modules already yielded whole
    wrapped: set[int] = set()  # the trained copies of modules_to_save already yielded
    # Tied parameters under their first name only, as save_pretrained keeps (listed before FSDP2 swaps any in).
    first_names = {n for n, _ in base.named_parameters()} | {n for n, _ in base.named_buffers()}
    with torch.no_grad():
        for name, module in base.named_modules(remove_duplicate=False):
            if any(name.startswith(prefix) for prefix in done):
                continue
            prefix = f"{name}." if name else ""
            if isinstance(module, LoraLayer):
                done.append(prefix)
                with units.unsharded(module, subtree=True):
                    tensors = dict(_merged_lora(module, prefix))
            elif isinstance(module, ModulesToSaveWrapper):
                done.append(prefix)
                trained = module.modules_to_save[module.active_adapters[0]]
                # a tied pair trained as one matrix (ensure_weight_tying) shares its copy: yielded once, as tied
                again = {k for k, p in trained.named_parameters() if id(p) in wrapped}
                wrapped.update(id(p) for p in trained.parameters())
                with units.unsharded(trained, subtree=True), sharded.gathered(list(trained.parameters())):
                    tensors = {prefix + k: t.detach().clone() for k, t in sharded.module_tensors(trained).items()
                               if k not in again}
            else:
                with units.unsharded(module):  # unsharding swaps in other parameter objects: read them inside
                    own = {prefix + k: t for k, t in sharded.module_tensors(module, recurse=False).items()
                           if prefix + k in first_names}
                    with sharded.gathered(list(own.values())):
                        tensors = {name: t.detach().clone() for name, t in own.items()}
            if tensors:  # a module's tensors hold whole conversion groups (one module's experts, say)
                yield from hub_names.to_hub(base, tensors).items()


def _merged_lora(module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The wrapped module's tensors with the active adapters' deltas added, under the module's own names."""
    from peft.tuners.lora import LoraLayer

    if any(module.use_dora.get(a, False) for a in module.active_adapters):
        raise MergeError("iter_merged_weights does not support DoRA adapters; use trl_ext.merge.merge",
                         kind="dora")
    with sharded.gathered(list(module.parameters())):
        deltas, layer = {}, module
        while isinstance(layer, LoraLayer):  # LoRA on parameters (MoE experts) nests one wrapper per parameter
            name = getattr(layer, "parameter_name", "weight")
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    deltas[name] = deltas.get(name, 0) + layer.get_delta_weight(adapter)
            layer = layer.base_layer
        for key, tensor in sharded.module_tensors(layer).items():
            merged = tensor.detach().clone()
            if key in deltas:
                merged += deltas[key].to(merged.dtype)
            yield prefix + key, merged
