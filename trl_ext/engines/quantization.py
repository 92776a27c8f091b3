"""QLoRA under DeepSpeed ZeRO: the 4-bit storage dtype each stage needs, one adapter dtype, and the refusals.

Why: ZeRO-3 partitions and all-gathers the packed 4-bit weights like every other parameter, and PEFT's DeepSpeed guide
prescribes ``bnb_4bit_quant_storage`` equal to the dtype DeepSpeed trains in for that (older DeepSpeed gathers a group
of parameters into one buffer of one dtype). Under any stage, DeepSpeed's mixed-precision cast (``p.data.to(bf16)``)
converts every floating parameter that is not already in its dtype: packed 4-bit bytes stored as another float dtype
would be converted as numbers. Integer storage (bitsandbytes' default uint8) is never cast, so ZeRO-1/2 keep it.
Storage is only a view of the same packed bytes: the choice costs no memory.

TRL casts QLoRA's trainable parameters to bf16 whatever the base dtype, which mixes dtypes (fp32 base + bf16 adapter
and reward head: "expected m1 and m2 to have the same dtype"; bf16 base + fp32 LoRA under ZeRO-3: trl#6089).
``match_adapter_dtype`` gives them the dtype the base computes in.

Combinations that cannot work are refused in the trainer's constructor, before TRL loads anything.
"""

import copy
import importlib.metadata
import importlib.util

import torch
from accelerate.utils import is_peft_model
from peft.utils.integrations import get_bnb_param_type

from trl_ext import patches
from trl_ext.engines import fsdp
from trl_ext.errors import ConfigError
from trl_ext.process.notices import notice

MIN_BITSANDBYTES = "0.46"  # first release with a CPU backend; pyproject's ``qlora`` extra pins it
_SPLITTING_DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # spread a model over devices


def zero_stage(args) -> int | None:
    """The active DeepSpeed ZeRO stage (from ``args.deepspeed`` or accelerate's plugin), None without DeepSpeed."""
    plugin = getattr(args, "deepspeed_plugin", None)
    return None if plugin is None else int(plugin.zero_stage or 0)


def deepspeed_dtype(args) -> torch.dtype:
    """The dtype DeepSpeed trains (and casts floating parameters) in: its bf16/fp16 sections, "auto" from the args."""
    config = args.deepspeed_plugin.deepspeed_config

    def enabled(section: str, fallback: bool) -> bool:
        value = (config.get(section) or {}).get("enabled", False)
        return bool(fallback) if value == "auto" else str(value).lower() == "true"

    if enabled("bf16", args.bf16) or enabled("bfloat16", args.bf16):
        return torch.bfloat16
    return torch.float16 if enabled("fp16", args.fp16) else torch.float32


def as_bnb_config(config):
    """A ``BitsAndBytesConfig`` for a bitsandbytes config given as one or as a dict (YAML, JSON), else None."""
    from transformers import BitsAndBytesConfig

    if isinstance(config, BitsAndBytesConfig):
        return config
    is_bnb_dict = isinstance(config, dict) and (
        config.get("quant_method") == "bitsandbytes"
        or ("quant_method" not in config and (config.get("load_in_4bit") or config.get("load_in_8bit")))
    )
    return BitsAndBytesConfig.from_dict(config) if is_bnb_dict else None


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _splits_model(device_map) -> bool:
    """True for a device map that spreads the model over several devices (or offloads part of it)."""
    if isinstance(device_map, str):
        return device_map in _SPLITTING_DEVICE_MAPS
    if isinstance(device_map, dict):
        return len({str(d) for d in device_map.values()}) > 1
    return False


def _refuse(message: str):
    raise ConfigError(f"QLoRA: {message}")


def _check_bitsandbytes() -> None:
    from packaging.version import Version

    if importlib.util.find_spec("bitsandbytes") is None:
        _refuse(f"bitsandbytes is not installed: pip install 'bitsandbytes>={MIN_BITSANDBYTES}' "
                "(or install trl_ext with the [qlora] extra).")
    version = importlib.metadata.version("bitsandbytes")
    if Version(version) < Version(MIN_BITSANDBYTES):
        _refuse(f"bitsandbytes {version} is too old: pip install -U 'bitsandbytes>={MIN_BITSANDBYTES}'.")


def _check_combination(args, *, eight_bit: bool, device_map, has_adapter: bool) -> None:
    stage = zero_stage(args)
    if eight_bit and stage == 3:
        _refuse("an 8-bit (load_in_8bit) base cannot be partitioned by DeepSpeed ZeRO-3: use load_in_4bit=True "
                "(4-bit QLoRA works under ZeRO-3), or ZeRO-2.")
    if stage is not None and _splits_model(device_map):
        _refuse(f"a quantized model placed with device_map={device_map!r} cannot train under DeepSpeed, which "
                "keeps a whole copy on each process's device: load it without device_map, or train without "
                "DeepSpeed.")
    if not has_adapter:
        _refuse("a quantized model cannot be trained whole: pass peft_config=LoraConfig(...) to train an adapter.")


def _fsdp_dtype(args, config) -> torch.dtype:
    """The dtype of the model's other weights under FSDP: the model's load dtype, else the 4-bit compute dtype."""
    init_kwargs = args.model_init_kwargs if isinstance(args.model_init_kwargs, dict) else {}
    dtype = init_kwargs.get("dtype", init_kwargs.get("torch_dtype"))
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    return dtype if isinstance(dtype, torch.dtype) else (config.bnb_4bit_compute_dtype or torch.float32)


def _storage_for(args, storage: torch.dtype, config=None) -> torch.dtype:
    """The 4-bit storage dtype that works under the active DeepSpeed stage or FSDP (``storage`` when it already does).

    FSDP all-gathers each layer's parameters as one flat buffer of one dtype, so the packed 4-bit weights are stored in
    the dtype of the others (PEFT's FSDP-QLoRA recipe: ``bnb_4bit_quant_storage`` = the model's dtype).
    """
    if fsdp.requested(args):
        return _fsdp_dtype(args, config)
    stage = zero_stage(args)
    if stage is None:
        return storage
    dtype = deepspeed_dtype(args)
    if stage == 3 or storage.is_floating_point:
        return dtype
    return storage


def adjust_for_engine(args, bound) -> None:
    """Before TRL's constructor: refuse what cannot work, and set the 4-bit storage dtype for the ZeRO stage.

    ``bound`` holds the trainer's arguments; a quantization config there (``quantization_config=``) or in
    ``args.model_init_kwargs`` is replaced by an adjusted copy, never modified in place.
    """
    model = bound.arguments.get("model")
    # accelerate's is_peft_model unwraps its argument: a model id (str) cannot be asked
    has_adapter = bound.arguments.get("peft_config") is not None or (
        not isinstance(model, str) and is_peft_model(model))
    if not isinstance(model, str):
        return _check_model_object(args, model, has_adapter)

    init_kwargs = args.model_init_kwargs if isinstance(args.model_init_kwargs, dict) else {}
    in_trainer_arg = bound.arguments.get("quantization_config") is not None
    given = bound.arguments["quantization_config"] if in_trainer_arg else init_kwargs.get("quantization_config")
    config = as_bnb_config(given)
    if config is None:
        return  # no quantization, or another method than bitsandbytes: not ours to judge
    _check_bitsandbytes()
    _check_combination(args, eight_bit=config.load_in_8bit, device_map=init_kwargs.get("device_map"),
                       has_adapter=has_adapter)

    if config.load_in_4bit:
        storage = _storage_for(args, config.bnb_4bit_quant_storage, config)
        if storage != config.bnb_4bit_quant_storage:
            engine = "FSDP" if fsdp.requested(args) else f"DeepSpeed ZeRO-{zero_stage(args)}"
            notice(f"QLoRA under {engine}: storing the 4-bit weights as {_dtype_name(storage)} "
                   f"(bnb_4bit_quant_storage, was {_dtype_name(config.bnb_4bit_quant_storage)}), "
                   f"the dtype {engine.split()[0]} trains the other weights in, so it shards and casts them like every "
                   "other parameter.")
            config = copy.deepcopy(config)
            config.bnb_4bit_quant_storage = storage
    if config is not given:  # a dict became a BitsAndBytesConfig, or the storage changed
        if in_trainer_arg:
            bound.arguments["quantization_config"] = config
        else:
            args.model_init_kwargs = {**init_kwargs, "quantization_config": config}


def _check_model_object(args, model, has_adapter: bool) -> None:
    """A model the user loaded quantized: refuse what its stored form cannot do under the active DeepSpeed stage."""
    base = model.get_base_model() if is_peft_model(model) else model
    four_bit, eight_bit = getattr(base, "is_loaded_in_4bit", False), getattr(base, "is_loaded_in_8bit", False)
    if not (four_bit or eight_bit):
        return
    _check_combination(args, eight_bit=eight_bit, device_map=getattr(base, "hf_device_map", None),
                       has_adapter=has_adapter)
    storage = _quant_storage(base)
    if four_bit and storage is not None and _storage_for(args, storage) != storage:
        needed = _dtype_name(_storage_for(args, storage))
        _refuse(f"this 4-bit model stores its weights as {_dtype_name(storage)}, but DeepSpeed ZeRO-{zero_stage(args)} "
                f"trains in {needed}: load it with BitsAndBytesConfig(..., bnb_4bit_quant_storage=torch.{needed}), "
                "or pass the model id and the trainer sets it.")


def _quant_storage(model) -> torch.dtype | None:
    """The dtype the packed 4-bit weights are stored in, read from the weights themselves."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is not None and get_bnb_param_type(weight) == "4bit":
            return weight.dtype
    return None


def base_compute_dtype(model) -> torch.dtype | None:
    """The dtype of the model's frozen floating (not quantized) parameters: norms, embeddings."""
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point() and not get_bnb_param_type(param):
            return param.dtype
    return None


def match_adapter_dtype(args, model) -> None:
    """After TRL's constructor: the trainable parameters of a quantized model take the dtype the base computes in.

    Under DeepSpeed that is the dtype it trains in (it keeps its own fp32 master copy). Without DeepSpeed only an
    fp32 base is changed (TRL's bf16 cast there mixes dtypes); a bf16 or fp16 base keeps TRL's choice.
    """
    if not (getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)):
        return
    if zero_stage(args) is not None:
        dtype = deepspeed_dtype(args)
    elif base_compute_dtype(model) == torch.float32:
        dtype = torch.float32
    else:
        return
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            cast_partition(param, dtype)  # under ZeRO-3 its partition holds the values


def disable_cpu_packed_path(model) -> int:
    """Keep bitsandbytes' 4-bit layers on the kernel they train with; returns how many layers were switched.

    On a CPU with AVX512-BF16, bitsandbytes (0.48-0.50) repacks a 4-bit weight in place the first time the layer
    runs in eval mode without grad (training-time evaluation, DPO's reference pass), and rounds its scales to bf16.
    Under ZeRO-3 the next gather then meets the repacked layout and fails; otherwise, the next ``state_dict()``
    (every save) unpacks it with the bf16 scales kept, so the base silently differs from the one loaded.
    """
    return keep_4bit_off_packed_path(model)


def keep_4bit_off_packed_path(model) -> int:
    """Keep bitsandbytes' 4-bit layers on the kernel they train with (patch ``bnb-cpu-packed-4bit``). Returns how
    many layers were switched."""
    layers = [m for m in model.modules() if getattr(m, "support_avx512bf16_for_cpu", False)]
    if layers and patches.applies("bnb-cpu-packed-4bit"):
        for layer in layers:
            layer.support_avx512bf16_for_cpu = False
        return len(layers)
    return 0


def cast_partition(param, dtype) -> None:
    """Cast a parameter and, under ZeRO-3, the partition that holds its values (patch ``partitioned-adapter-dtype``)."""
    param.data = param.data.to(dtype)
    if getattr(param, "ds_tensor", None) is not None and patches.applies("partitioned-adapter-dtype"):
        param.ds_tensor.data = param.ds_tensor.data.to(dtype)
