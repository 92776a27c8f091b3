"""The weight sync from the trained policy into vLLM (GRPO, RLOO), bounded to one module at a time.

TRL 1.16's ``VLLMGeneration._iter_named_params`` gathers every parameter of a PEFT model at once under ZeRO-3 to merge
the adapter (trl#5766: the whole model on every rank), and renames by string rules (strip ``base_model.model.`` and
``.base_layer``), which gives in-memory names: fused MoE experts and ``model.language_model.*`` prefixes that are not
the checkpoint names vLLM's ``load_weights`` takes. ``BoundedVLLMGeneration`` replaces only that walk with
``merge.iter_merged_weights``: gather one module, merge its adapter, yield the names and layout ``save_pretrained``
writes (which vLLM loads from disk by construction), release. Everything else (colocate and server modes, waking the
weights from sleep mode before loading, trl#5312 / trl#5142, prefix-cache reset) stays TRL's ``sync_weights``.
"""

from collections.abc import Iterator

import torch
from trl.generation.vllm_generation import VLLMGeneration

from trl_ext.merge.weights import iter_merged_weights


def engine_dtype(generation: VLLMGeneration) -> torch.dtype | None:
    """The dtype of the colocated vLLM engine's weights, or None when unknown (server mode): then tensors are sent
    in the policy's dtype and vLLM's loader casts them, as with TRL's own walk."""
    dtype = getattr(getattr(getattr(getattr(generation, "llm", None), "llm_engine", None), "model_config", None),
                    "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def bounded_named_params(generation: VLLMGeneration) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for vLLM's ``load_weights``: merged, in the Hub's layout, one module gathered at a time.

    Args:
        generation: TRL's ``VLLMGeneration`` (its ``model`` is the policy: a PEFT or plain transformers model).

    Yields:
        Hub-named tensors on the training device, in the engine's dtype when known. Tied weights come once.
    """
    dtype = engine_dtype(generation)
    device = generation.accelerator.device
    for name, tensor in iter_merged_weights(generation.model):
        yield name, tensor.to(device=device, dtype=dtype or tensor.dtype)


def _is_quantized(model) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(base, "is_quantized", False))


class BoundedVLLMGeneration(VLLMGeneration):
    """TRL's ``VLLMGeneration`` with the bounded, Hub-named parameter walk (see the module docstring).

    FSDP1 (TRL walks its flat parameters module by module) and quantized bases (4-bit weights merge in TRL's
    ``merge_adapter``) keep TRL's walk. Under FSDP2 the bounded walk unshards one FSDP unit at a time.
    """

    def _iter_named_params(self):
        fsdp1 = self._dist.is_fsdp and getattr(self._dist, "fsdp_version", 1) != 2
        if fsdp1 or _is_quantized(self.model):
            yield from super()._iter_named_params()
        else:
            yield from bounded_named_params(self)
