"""A LoRA adapter as the streamed merge uses it: for each base tensor it changes, what replaces it, one block of rows
at a time, with PEFT's semantics, and a check of every merged block against the adapter's own formula.

PEFT decides which modules are adapted and how (``target_modules``, ``all-linear``, ``rank_pattern`` /
``alpha_pattern``, ``use_rslora``, ``fan_in_fan_out`` for GPT-2's ``Conv1D``, DoRA, ``lora_bias``): the adapter's
config is injected into a model on the meta device, and each LoRA layer's settings (``scaling``, ``fan_in_fan_out``,
its variant) are read from there. The arithmetic is PEFT's (``Linear.get_delta_weight`` and ``merge``,
``Embedding.merge``, ``DoraLinearVariant.merge_unsafe``), applied to rows: each of these merges computes a row of the
merged weight from that row alone, so no weight is ever in memory whole.
"""

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trl_ext.errors import AdapterError
from trl_ext.files.reader import SafetensorsReader

ADAPTER_NAME = "default"  # the name PEFT gives the one adapter it loads
PEFT_PREFIX = "base_model.model."
PROBE_INPUTS = 4  # random input vectors per merged weight for the check
# The check's tolerance is this many standard deviations of the rounding error (random inputs make W'x - Wx a sum of
# independent roundings): a wrong delta (wrong scale, transposition or rows) is far outside it.
CHECK_SIGMAS = 8.0





class AdapterWeights:
    """The adapter's tensors: read lazily from its safetensors file, or held (an adapter PEFT had to convert)."""

    def __init__(self, reader: SafetensorsReader | None = None, tensors: dict[str, torch.Tensor] | None = None):
        self._reader, self._tensors = reader, tensors

    @property
    def names(self) -> list[str]:
        return list(self._tensors if self._tensors is not None else self._reader.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape) if self._tensors is not None else self._reader.spec(name).shape

    def read(self, name: str) -> torch.Tensor:
        return self._tensors[name] if self._tensors is not None else self._reader.read(name)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()


def _as_peft_holds_it(tensor: torch.Tensor) -> torch.Tensor:
    """PeftModel.from_pretrained (``autocast_adapter_dtype=True``) keeps fp16/bf16 adapter weights in float32."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


@dataclass
class LoraDelta:
    """The LoRA delta of one base weight: ``W' = W + scaling * B @ A`` (transposed for ``fan_in_fan_out`` layers and
    embeddings), DoRA's rescaling when ``magnitude`` is set, and ``lora_bias`` for the bias."""

    module: str  # in-memory module name
    a: str  # adapter tensor names
    b: str
    scaling: float
    transposed: bool  # the weight is (B @ A).T-shaped: GPT-2's Conv1D (fan_in_fan_out) and embeddings
    delta_in_weight_dtype: bool  # PEFT's Embedding.merge casts the delta to the weight's dtype before adding
    magnitude: str | None = None  # DoRA
    bias: str | None = None  # lora_B.bias (lora_bias=True)

    def weight_shape(self, weights: AdapterWeights) -> tuple[int, int]:
        """The base weight shape this delta fits."""
        (_, fan_in), (fan_out, _) = weights.shape(self.a), weights.shape(self.b)
        return (fan_in, fan_out) if self.transposed else (fan_out, fan_in)


@dataclass
class Adapter:
    """What an adapter changes, by in-memory parameter name."""

    config: object  # its peft LoraConfig
    weights: AdapterWeights
    deltas: dict[str, LoraDelta] = field(default_factory=dict)  # "<module>.weight" -> delta
    bias_deltas: dict[str, LoraDelta] = field(default_factory=dict)  # "<module>.bias" -> delta (lora_bias)
    replacements: dict[str, str] = field(default_factory=dict)  # modules_to_save: parameter -> adapter tensor name
    # Base values saved with the adapter (PEFT's save_embedding_layers: a resized or LoRA-targeted embedding), which
    # PeftModel.from_pretrained loads over the base's: parameter -> adapter tensor name.
    overrides: dict[str, str] = field(default_factory=dict)


def _refuse_config(config) -> None:
    from peft import PeftType

    if config.peft_type != PeftType.LORA:
        raise AdapterError(f"the adapter is {config.peft_type.value}, and the streamed merge applies LoRA adapters "
                           "only; merge it in memory with trl_ext.merge.in_memory.merge")
    if getattr(config, "target_parameters", None):
        raise AdapterError(
            f"the adapter puts LoRA on parameters ({', '.join(config.target_parameters)}; PEFT target_parameters, "
            "e.g. fused MoE experts), which the checkpoint stores as other tensors; the streamed merge does not split "
            "such deltas: merge it in memory with trl_ext.merge.in_memory.merge")
    if getattr(config, "layer_replication", None):
        raise AdapterError("the adapter uses layer_replication, which adds layers to the base: merge it in memory "
                           "with trl_ext.merge.in_memory.merge")


def _lora_delta(name: str, module, weights: set[str]) -> LoraDelta:
    from peft.tuners.lora.layer import Embedding, Linear
    from peft.tuners.lora.variants import DoraLinearVariant

    prefix = f"{PEFT_PREFIX}{name}."
    variant = getattr(module, "lora_variant", {}).get(ADAPTER_NAME)
    dora = isinstance(variant, DoraLinearVariant)
    kind = f"LoRA on {name} ({type(module.get_base_layer()).__name__}"
    if type(module) is Linear and (variant is None or (dora and not module.fan_in_fan_out)):
        delta = LoraDelta(name, prefix + "lora_A.weight", prefix + "lora_B.weight", module.scaling[ADAPTER_NAME],
                          transposed=module.fan_in_fan_out, delta_in_weight_dtype=False,
                          magnitude=prefix + "lora_magnitude_vector" if dora else None,
                          bias=prefix + "lora_B.bias" if module.lora_bias[ADAPTER_NAME] else None)
    elif type(module) is Embedding and variant is None:
        delta = LoraDelta(name, prefix + "lora_embedding_A", prefix + "lora_embedding_B", module.scaling[ADAPTER_NAME],
                          transposed=True, delta_in_weight_dtype=True)
    else:
        what = f"{type(variant).__name__} " if variant is not None else ""
        raise AdapterError(f"{kind}, a {what}{type(module).__name__} layer) is not something the streamed merge "
                           "applies (it merges LoRA and DoRA on linear layers, LoRA on embeddings): merge it in memory "
                           "with trl_ext.merge.in_memory.merge")
    missing = [n for n in (delta.a, delta.b, delta.magnitude, delta.bias) if n is not None and n not in weights]
    if missing:
        raise AdapterError(f"the adapter does not fit this base model: its config adapts {name}, but it has no "
                           f"{missing[0].removeprefix(prefix)} for it")
    return delta


def _adapter_weights(path: Path, config, peft_model) -> AdapterWeights:
    """Lazily read unless PEFT's transformers-5 conversion of adapter keys (MoE, renamed layouts) changes them."""
    from peft.utils import load_peft_weights
    from peft.utils.transformers_weight_conversion import convert_peft_adapter_state_dict_for_transformers

    file = path / "adapter_model.safetensors"
    if file.exists():
        reader = SafetensorsReader([file])
        meta = {n: torch.empty(s.spec.shape, dtype=s.spec.dtype, device="meta") for n, s in reader.tensors.items()}
        converted = convert_peft_adapter_state_dict_for_transformers(peft_model, config, meta)
        if converted.keys() == meta.keys() and all(converted[n] is meta[n] for n in meta):
            return AdapterWeights(reader=reader)
        reader.close()
    tensors = load_peft_weights(str(path), device="cpu")
    return AdapterWeights(tensors=convert_peft_adapter_state_dict_for_transformers(peft_model, config, tensors))


def load_adapter(path: Path, model: torch.nn.Module) -> Adapter:
    """Read the adapter at ``path`` against ``model`` (the base, on the meta device; not modified).

    Args:
        path: the adapter directory (``adapter_config.json`` and ``adapter_model.safetensors`` or ``.bin``).
        model: the model the adapter applies to, instantiated on the meta device.

    Returns:
        An ``Adapter`` naming, for each base parameter it changes, the delta or the replacement.

    Raises:
        AdapterError: an adapter type, layer or option the streamed merge does not apply, or tensors that do not
            belong to this model.
    """
    from peft import PeftConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from peft.utils import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    try:
        config = PeftConfig.from_pretrained(str(path))
    except (ValueError, TypeError, KeyError) as exc:
        raise AdapterError(f"cannot read {path / 'adapter_config.json'}: {exc}".splitlines()[0]) from exc
    _refuse_config(config)
    try:  # PEFT's own matching of target_modules, on a copy (PEFT wraps modules in place)
        peft_model = get_peft_model(copy.deepcopy(model), copy.deepcopy(config), low_cpu_mem_usage=True)
    except ValueError as exc:
        raise AdapterError(f"the adapter does not fit this base model: {exc}".splitlines()[0]) from exc
    weights = _adapter_weights(path, config, peft_model)
    names = set(weights.names)
    adapter, used = Adapter(config, weights), set()
    for name, module in peft_model.get_base_model().named_modules():
        if isinstance(module, LoraLayer):
            used |= _take_lora_layer(adapter, name, module, names)
        elif isinstance(module, ModulesToSaveWrapper):
            used |= _take_modules_to_save(adapter, name, names)
        elif isinstance(module, AuxiliaryTrainingWrapper):
            raise AdapterError(f"the adapter trains {name} through {type(module).__name__} (e.g. "
                               "trainable_token_indices), which the streamed merge does not apply: merge it in memory "
                               "with trl_ext.merge.in_memory.merge")
    unused = sorted(names - used)
    if unused:
        raise AdapterError(f"the adapter does not fit this base model: {len(unused)} of its tensors belong to no "
                           f"module the base has (e.g. {unused[0]})")
    return adapter


def _take_lora_layer(adapter: Adapter, name: str, module, names: set[str]) -> set[str]:
    """One LoRA layer's delta (and bias delta), and the base layer's tensors the adapter saved; returns the names
    taken."""
    if type(module).__name__ == "ParamWrapper":  # target_parameters, also refused from the config
        raise AdapterError(f"LoRA on parameters of {name} is not something the streamed merge applies: "
                           "merge it in memory with trl_ext.merge.in_memory.merge")
    delta = _lora_delta(name, module, names)
    adapter.deltas[f"{name}.weight"] = delta
    if delta.bias is not None:
        adapter.bias_deltas[f"{name}.bias"] = delta
    used = {n for n in (delta.a, delta.b, delta.magnitude, delta.bias) if n}
    base_layer = f"{PEFT_PREFIX}{name}.base_layer."
    for key in sorted(n for n in names if n.startswith(base_layer)):
        adapter.overrides[f"{name}.{key.removeprefix(base_layer)}"] = key
        used.add(key)
    return used


def _take_modules_to_save(adapter: Adapter, name: str, names: set[str]) -> set[str]:
    """A module PEFT saves whole (``modules_to_save``): its trained tensors replace the base's; returns the names
    taken."""
    used, prefix = set(), f"{PEFT_PREFIX}{name}."
    for key in sorted(n for n in names if n.startswith(prefix)):
        rest = key.removeprefix(prefix)
        if rest.startswith("original_module."):  # the untrained module, as PEFT loads it (tied aliases see it)
            adapter.overrides[f"{name}.{rest.removeprefix('original_module.')}"] = key
        elif not rest.startswith("modules_to_save."):  # that copy of the trained module PEFT does not load
            adapter.replacements[f"{name}.{rest}"] = key
        used.add(key)
    return used


@dataclass
class CheckResult:
    """The worst block of a merged weight: ``|W'x - (Wx + scaling * B(Ax))|`` against its tolerance."""

    max_error: float = 0.0
    worst_ratio: float = 0.0  # error / tolerance; above 1 fails


class RowMerger:
    """Merges one weight block by block (blocks of whole rows, in order), and checks each block on random inputs.

    Args:
        delta: the weight's LoRA delta.
        weights: the adapter's tensors (its factors are read once, here).
        shape: the base weight's shape.
        seed: makes the random inputs reproducible.
    """

    def __init__(self, delta: LoraDelta, weights: AdapterWeights, shape: tuple[int, ...], seed: int = 0):
        self.delta = delta
        self.a, self.b = _as_peft_holds_it(weights.read(delta.a)), _as_peft_holds_it(weights.read(delta.b))
        self.magnitude = _as_peft_holds_it(weights.read(delta.magnitude)) if delta.magnitude else None
        self.rank = self.a.shape[0]
        self.generator = torch.Generator().manual_seed(seed)
        self.columns = shape[1]
        self.result = CheckResult()
        self._x = self._factor_x = None

    def _inputs(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Random inputs ``x`` (columns) and the first factor applied to them: ``A x`` (or ``B^T x``, transposed)."""
        if self._x is None:
            self._x = torch.randn(self.columns, PROBE_INPUTS, generator=self.generator, dtype=torch.float64).to(dtype)
            first = self.b.T if self.delta.transposed else self.a
            self._factor_x = first.to(dtype) @ self._x
        return self._x, self._factor_x

    def delta_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of PEFT's ``transpose(B @ A, fan_in_fan_out) * scaling``."""
        if self.delta.transposed:
            return (self.b @ self.a[:, start:stop]).T * self.delta.scaling
        return (self.b[start:stop] @ self.a) * self.delta.scaling

    def merge(self, block: torch.Tensor, start: int) -> torch.Tensor:
        """Merge rows ``start:start+len(block)`` of the weight into ``block`` (in place) and check them."""
        stop = start + block.shape[0]
        # The check runs in float64 for fp32/fp64 weights and in float32 for 16-bit ones: its own rounding stays far
        # below the weight's.
        check_dtype = torch.float64 if block.dtype.itemsize >= 4 else torch.float32
        x, factor_x = self._inputs(check_dtype)
        work = block.to(check_dtype, copy=True)  # the rows before the merge
        before = work @ x
        delta = self.delta_rows(start, stop)
        lora_y = self.delta.scaling * ((self.a[:, start:stop].T if self.delta.transposed else self.b[start:stop])
                                       .to(check_dtype) @ factor_x)
        scale = torch.linalg.vector_norm(work, dim=1) + torch.linalg.vector_norm(delta, dim=1).to(check_dtype)
        if self.magnitude is not None:  # DoRA (DoraLinearVariant.merge_unsafe): rows rescaled to the magnitude
            combined = block + delta
            norm = torch.linalg.norm(combined, dim=1).to(combined.dtype)
            factor = (self.magnitude[start:stop] / norm).view(-1, 1)
            block.copy_((factor * combined).to(block.dtype))
            expected = factor.to(check_dtype) * (before + lora_y)
            scale = scale * factor.abs().view(-1).to(check_dtype)
        else:  # Linear.merge / Embedding.merge, unsafe path
            block += delta.to(block.dtype) if self.delta.delta_in_weight_dtype else delta
            expected = before + lora_y
        work.copy_(block)  # the rows as written
        self._record(work @ x - expected, scale, block.dtype, delta.dtype)
        return block

    def _record(self, error: torch.Tensor, scale: torch.Tensor, weight_dtype, delta_dtype) -> None:
        # Each merged value is rounded to the weight's dtype (half an epsilon, relative; the delta may be rounded
        # first, as PEFT's Embedding.merge does) and the delta is computed in the adapter's dtype (about sqrt(rank)
        # epsilons of each value). On random Gaussian inputs the error of W'x is then a normal variable whose standard
        # deviation per row is at most that, times the row's norm, which is at most ||W_row|| + ||delta_row||.
        eps, delta_eps = torch.finfo(weight_dtype).eps, torch.finfo(delta_dtype).eps
        sigma = (eps + (4 + math.sqrt(self.rank)) * delta_eps) * scale
        tolerance = CHECK_SIGMAS * sigma.view(-1, 1) + torch.finfo(torch.float32).tiny
        error = error.abs()
        if error.numel():
            self.result.max_error = max(self.result.max_error, float(error.max()))
            self.result.worst_ratio = max(self.result.worst_ratio, float((error / tolerance).max()))


def merge_bias(bias: torch.Tensor, delta: LoraDelta, weights: AdapterWeights) -> torch.Tensor:
    """PEFT's ``lora_bias`` merge: ``bias += lora_B.bias * scaling`` (in place, returned)."""
    bias += _as_peft_holds_it(weights.read(delta.bias)) * delta.scaling
    return bias
