"""What each tensor of a streamed merge's output is made of, decided from names, shapes and dtypes alone.

Every base tensor is copied as it is, or merged with its LoRA delta, or replaced by the adapter's own copy
(``modules_to_save``: a reward model's ``score``, a resized ``embed_tokens``/``lm_head``). Tensors the base checkpoint
does not hold are added: a new classification head, and the output embedding of a tied model whose embeddings the
adapter changed (the merged model is untied, so that it computes what the adapter model computes). Base tensors the
merged model has no place for (``lm_head`` when a causal LM becomes a sequence classifier) are left out.
"""

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from trl_ext.errors import PlanError
from trl_ext.files.reader import SafetensorsReader
from trl_ext.files.shards import TensorSpec
from trl_ext.merge.lora_deltas import Adapter, LoraDelta
from trl_ext.merge.names import checkpoint_to_memory, saved_name


@dataclass(frozen=True)
class Output:
    """One tensor of the merged checkpoint: its spec (name, shape, dtype as written) and where its values come from:
    the adapter tensor ``adapter_source`` if set (a ``modules_to_save`` copy, or base values saved with the adapter),
    else the base tensor ``source``; then the LoRA delta, if any."""

    spec: TensorSpec
    source: str | None = None
    adapter_source: str | None = None
    delta: LoraDelta | None = None  # LoRA delta for a weight
    bias_delta: LoraDelta | None = None  # lora_bias delta for a bias


@dataclass
class MergePlan:
    outputs: list[Output] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # base tensors the merged model has no place for
    vocab_size: int | None = None  # the adapter's vocabulary, when it resized the embeddings
    untie: bool = False  # tied embeddings that the adapter changed: the merged model stores both

    @property
    def nbytes(self) -> int:
        return sum(o.spec.nbytes for o in self.outputs)


def _tied_groups(model: torch.nn.Module) -> dict[str, list[str]]:
    """In-memory names that share one tensor (tied embeddings), each name -> all of them."""
    by_tensor = defaultdict(list)
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_tensor[id(tensor)].append(name)
    return {name: names for names in by_tensor.values() if len(names) > 1 for name in names}


def _embedding_names(model: torch.nn.Module) -> set[str]:
    modules = {id(m): n for n, m in model.named_modules()}
    found = [model.get_input_embeddings(), model.get_output_embeddings()]
    return {f"{modules[id(m)]}.weight" for m in found if m is not None and id(m) in modules}


class _Sources:
    """Where each in-memory parameter's values come from, as PeftModel.from_pretrained would have them."""

    def __init__(self, reader: SafetensorsReader, model: torch.nn.Module, adapter: Adapter):
        loaded = checkpoint_to_memory(model, list(reader.tensors))
        self.reader, self.adapter, self.loaded = reader, adapter, loaded
        self.stored = {hit.memory_name: name for name, hit in loaded.items() if not hit.fused}
        self.fused = {hit.memory_name for hit in loaded.values() if hit.fused}
        self.meta = model.state_dict()
        self.tied = _tied_groups(model)

    def _group(self, name: str) -> list[str]:
        return [name, *(n for n in self.tied.get(name, []) if n != name)]

    def checkpoint(self, name: str) -> str | None:
        """The base tensor holding this parameter (a tied alias's is its partner's)."""
        return next((self.stored[n] for n in self._group(name) if n in self.stored), None)

    def override(self, name: str) -> str | None:
        """Base values the adapter saved for this parameter (or for its tied partner: they share one tensor)."""
        return next((self.adapter.overrides[n] for n in self._group(name) if n in self.adapter.overrides), None)

    def base_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of the values the delta applies to."""
        override, checkpoint = self.override(name), self.checkpoint(name)
        if override:
            return self.adapter.weights.shape(override)
        return self.reader.spec(checkpoint).shape if checkpoint else None

    def final_shape(self, name: str) -> tuple[int, ...] | None:
        replacement = self.adapter.replacements.get(name)
        return self.adapter.weights.shape(replacement) if replacement else self.base_shape(name)


def _out_dtype(dtype: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    return cast if cast is not None and dtype.is_floating_point else dtype


def build_plan(reader: SafetensorsReader, model: torch.nn.Module, adapter: Adapter, *, cast: torch.dtype | None,
               new_dtype: torch.dtype, keep_unknown: bool) -> MergePlan:
    """Decide every output tensor.

    Args:
        reader: the base checkpoint.
        model: the merged model's class on the meta device (a sequence classifier for a SEQ_CLS adapter).
        adapter: what the adapter changes, by in-memory name.
        cast: the dtype to write floating tensors in, or None to keep each tensor's.
        new_dtype: the dtype of tensors the base does not have (a new head) when ``cast`` is None.
        keep_unknown: copy base tensors the model has no place for (False when the architecture changes).

    Returns:
        The ``MergePlan``, outputs in the base checkpoint's order, added tensors last.

    Raises:
        PlanError: a delta or replacement whose shape does not fit the base tensor, LoRA on a tensor the checkpoint
            stores fused or does not hold, or resized embeddings that are not all saved by the adapter.
    """
    sources = _Sources(reader, model, adapter)
    changed = set(adapter.deltas) | set(adapter.bias_deltas) | set(adapter.replacements) | set(adapter.overrides)
    _refuse_what_cannot_change(sources, adapter, changed)
    plan = MergePlan(untie=any(name in sources.tied for name in changed))
    plan.vocab_size = _check_shapes(sources, model)

    def output(saved: str, name: str) -> Output:
        checkpoint = sources.checkpoint(name)
        values = adapter.replacements.get(name) or sources.override(name)
        if values is None and checkpoint is None:
            raise PlanError(f"the adapter does not fit this base model: it has a LoRA delta for {name}, whose base "
                            "weight the checkpoint does not hold")
        dtype = _out_dtype(reader.spec(checkpoint).dtype if checkpoint else new_dtype, cast)
        delta = None if name in adapter.replacements else adapter.deltas.get(name)
        bias_delta = None if name in adapter.replacements else adapter.bias_deltas.get(name)
        return Output(TensorSpec(saved, sources.final_shape(name), dtype), checkpoint, values, delta, bias_delta)

    for name in reader.tensors:
        hit = sources.loaded.get(name)
        if hit is None and not keep_unknown:
            plan.dropped.append(name)
        elif hit is None or hit.fused:
            spec = reader.spec(name)
            plan.outputs.append(Output(TensorSpec(name, spec.shape, _out_dtype(spec.dtype, cast)), name))
        else:
            plan.outputs.append(output(name, hit.memory_name))
    # Parameters the checkpoint does not store under their own name: a new head, or a tied alias made separate.
    for name in sources.meta:
        if name in sources.stored:
            continue
        if name in changed or (plan.untie and any(n in changed for n in sources.tied.get(name, []))):
            plan.outputs.append(output(saved_name(model, name), name))
    return plan


def _refuse_what_cannot_change(sources: "_Sources", adapter: Adapter, changed: set[str]) -> None:
    """A change to a tensor the checkpoint stores fused, a bias delta without a base bias, or a tensor the model
    lacks: one line each."""
    for name in sorted(changed):
        if name in sources.fused:
            raise PlanError(f"the adapter changes {name}, which transformers builds from several checkpoint tensors "
                            "(fused MoE experts, say); the streamed merge does not split such deltas: merge it in "
                            "memory with trl_ext.merge.in_memory.merge")
        if name not in sources.meta and name in adapter.bias_deltas:
            raise PlanError(f"the adapter has lora_bias for {name.removesuffix('.bias')}, whose base layer has no "
                            "bias: there is nothing to merge it into (PEFT refuses this merge too)")
        if name not in sources.meta:
            raise PlanError(f"the adapter does not fit this base model: it changes {name}, which the model lacks")


def _check_shapes(sources: _Sources, model: torch.nn.Module) -> int | None:
    """Every delta fits the values it applies to; the adapter changes no shape except, all at once, the vocabulary.
    Returns the new vocabulary size, if any."""
    adapter = sources.adapter
    for name, delta in adapter.deltas.items():
        shape = sources.base_shape(name)
        if shape is not None and tuple(shape) != delta.weight_shape(adapter.weights):
            raise PlanError(f"the adapter does not fit this base model: its delta for {name} has shape "
                            f"{list(delta.weight_shape(adapter.weights))}, the base weight {list(shape)}")
    for name, delta in adapter.bias_deltas.items():
        shape = sources.base_shape(name)
        if shape is not None and tuple(shape) != adapter.weights.shape(delta.bias):
            raise PlanError(f"the adapter does not fit this base model: its lora_B.bias for {name} has shape "
                            f"{list(adapter.weights.shape(delta.bias))}, the base bias {list(shape)}")
    embeddings, vocab = _embedding_names(model), {}
    for name in set(adapter.replacements) | set(adapter.overrides):
        checkpoint = sources.checkpoint(name)
        before = sources.reader.spec(checkpoint).shape if checkpoint else tuple(sources.meta[name].shape)
        after = sources.final_shape(name)
        if tuple(after) == tuple(before):
            continue
        if name in embeddings and len(after) == len(before) == 2 and after[1] == before[1]:
            vocab[name] = after[0]
            continue
        raise PlanError(f"the adapter does not fit this base model: its {name} has shape {list(after)}, the base's "
                        f"{list(before)}")
    if not vocab:
        return None
    sizes = {tuple(sources.final_shape(n) or ())[:1] for n in embeddings}
    if len(sizes) > 1:
        raise PlanError(f"the adapter resized the vocabulary ({', '.join(f'{n}: {s} rows' for n, s in vocab.items())}) "
                        f"but not every embedding ({', '.join(sorted(embeddings - set(vocab)))} keeps the base's "
                        "size): train every embedding through modules_to_save when resizing")
    return next(iter(vocab.values()))
