"""FSDP2 on machines without a GPU: accelerate's FSDP path, run on CPU processes with gloo.

accelerate selects FSDP only from a GPU-like distributed type (``AcceleratorState`` checks MULTI_GPU, MULTI_XPU, ...);
on CPU it sets up plain data parallelism and ignores the FSDP config, so a run "works" without sharding anything.
``fully_shard``, its reduce-scatter and DCP all run on CPU with gloo (torch >= 2.6), so trl_ext promotes the CPU
state to FSDP, as it already lets DeepSpeed run on CPU.

It also makes ``fsdp_cpu_ram_efficient_loading`` mean what it says under FSDP2: only the first process of each
machine reads the weights (see ``rank0_loading``).
"""

import contextlib
import dataclasses
import os
from pathlib import Path

import torch

from trl_ext import patches
from trl_ext.process import notice


def requested(args) -> bool:
    """True if FSDP is asked for, by the training arguments or by ``accelerate launch`` (an FSDP config)."""
    return bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def _reads_weights() -> bool:
    """False on the processes that ``fsdp_cpu_ram_efficient_loading`` keeps from reading weights under FSDP2 (all but
    the first of each machine, as transformers decides it); they get their shards from rank 0 when sharded."""
    from transformers.distributed.utils import is_local_dist_rank_0
    from transformers.integrations import is_fsdp_enabled

    return not (is_fsdp_enabled() and os.environ.get("FSDP_VERSION") == "2" and not is_local_dist_rank_0())


@contextlib.contextmanager
def rank0_loading(trl_module, args):
    """While TRL's constructor runs: with ``fsdp_cpu_ram_efficient_loading`` under FSDP2, only the first process of
    each machine reads the weights of the models it loads; the others build them on the meta device.

    transformers 5 still leaves those ranks' parameters on meta and skips their initialisation when the flag is set
    (``is_fsdp_enabled()``), expecting them to be filled by rank 0's broadcast, but its loader reads every weight on
    every rank anyway (transformers#43749). Here those ranks read only the files' headers (names, shapes, dtypes), as
    transformers does for ZeRO-3; accelerate's FSDP2 preparation of the trained model broadcasts rank 0's weights.
    TRL prepares its reference model with a bare ``fully_shard`` that never broadcasts, so with the flag it is prepared
    by accelerate's FSDP2 preparation instead, frozen (it is never trained).

    Args:
        trl_module: the module of the TRL trainer being built (its ``prepare_fsdp`` prepares the reference model).
        args: the trainer's config.
    """
    from transformers import PreTrainedModel

    # precompute_ref_log_probs: TRL hashes the reference model's values before it is sharded, so every rank reads
    if (os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() != "true"
            or getattr(args, "precompute_ref_log_probs", False)):
        yield
        return
    load = PreTrainedModel.__dict__["_load_pretrained_model"].__func__
    prepare_reference = getattr(trl_module, "prepare_fsdp", None)

    def load_headers_only(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        if (state_dict is None and checkpoint_files and load_config.device_map is None
                and not load_config.is_quantized and not _reads_weights()):
            from transformers.modeling_utils import load_state_dict

            state_dict = {}
            for file in checkpoint_files:
                state_dict.update(load_state_dict(file, map_location="meta", weights_only=load_config.weights_only))
            # the loader places what it loads on the map's device (CPU by default): here, empty tensors stay on meta
            load_config = dataclasses.replace(load_config, device_map={"": "meta"})
        return load(model, state_dict, checkpoint_files, load_config, *args, **kwargs)

    def prepare_with_broadcast(model, accelerator):
        if not is_fsdp2(accelerator) or not accelerator.state.fsdp_plugin.cpu_ram_efficient_loading:
            return prepare_reference(model, accelerator)
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        model.requires_grad_(False)  # also keeps accelerate from upcasting it to fp32 under mixed precision
        wrap_layers_the_model_has(accelerator, model)
        model = fsdp2_prepare_model(accelerator, model)
        model.eval()  # as TRL's prepare_fsdp leaves it
        return model

    reference = (patches.swapped("reference-model-broadcast", trl_module, "prepare_fsdp", prepare_with_broadcast)
                 if prepare_reference is not None else contextlib.nullcontext())
    with patches.swapped("rank0-loading", PreTrainedModel, "_load_pretrained_model",
                         staticmethod(load_headers_only)), reference:
        yield


def give_meta_parameters_storage(model) -> None:
    """Replace ``model``'s parameters left on the meta device by ``rank0_loading`` with uninitialised CPU tensors.

    accelerate maps the optimizer's parameters to their shards by storage address, and every meta tensor has the
    same address (0): each parameter needs storage of its own. It is never written (the pages are never touched, so
    it costs no memory): accelerate moves the model back to meta before filling the shards from rank 0.

    Args:
        model: the model TRL built (a PEFT model or a transformers model); tied parameters stay tied.
    """
    made = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                if id(param) not in made:
                    made[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="cpu"),
                                                         requires_grad=param.requires_grad)
                setattr(module, name, made[id(param)])


def is_fsdp2(accelerator) -> bool:
    """True when ``accelerator`` shards the model with FSDP2 (``fully_shard``)."""
    return bool(getattr(accelerator, "is_fsdp2", False))


def load_checkpoint_weights(model, checkpoint: str) -> None:
    """Load weights saved by trl_ext (adapters, or a full model in the Hub's layout) into an FSDP2-sharded model.

    Each rank reads only its own rows of each tensor from the safetensors files (memory-mapped), so no rank ever
    holds the whole model. A full model whose Hub layout differs from memory (fused MoE experts, say) is converted
    by ``from_pretrained`` instead, on CPU in every rank.

    Args:
        model: the model being trained, sharded by FSDP2 (a PEFT model or a transformers model).
        checkpoint: a ``checkpoint-N`` directory written by trl_ext.

    Raises:
        KeyError: a tensor the model needs is missing from the checkpoint.
    """
    import torch.distributed as dist
    from safetensors import safe_open

    from trl_ext.saving import gather
    from trl_ext.saving import plan as save_plan

    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    for weight_set in save_plan.plan_weight_sets(model):
        directory = Path(checkpoint) / weight_set.subdir
        if any(unit.converted for unit in weight_set.units):
            _load_converted(model, directory)
            continue
        files = {name: directory / file for file, specs in weight_set.plan.items() for name in
                 (s.name for s in specs)}
        handles = {}
        with torch.no_grad():
            for unit in weight_set.units:
                name, live = unit.outputs[0].name, unit.sources[0][1]
                path = files[name]
                if path not in handles:
                    handles[path] = safe_open(str(path), framework="pt", device="cpu")
                rows = gather.dtensor_rows(live, world, rank) if gather.is_dtensor(live) else slice(None)
                if rows is None:  # another placement: distribute the whole tensor as the model places it
                    from torch.distributed.tensor import distribute_tensor

                    whole = handles[path].get_tensor(name).to(live.dtype)
                    live.to_local().copy_(distribute_tensor(whole, live.device_mesh, live.placements).to_local())
                    continue
                target = live.to_local() if gather.is_dtensor(live) else live.data
                target.copy_(handles[path].get_slice(name)[rows].to(target.dtype))


def _load_converted(model, directory: Path) -> None:
    from torch.distributed.tensor import distribute_tensor

    from trl_ext.saving import gather

    loaded = type(model).from_pretrained(str(directory), dtype=model.dtype, config=model.config).state_dict()
    with torch.no_grad():
        for name, live in gather.state_tensors(model).items():
            whole = loaded[name].to(live.dtype)
            if gather.is_dtensor(live):
                live.to_local().copy_(distribute_tensor(whole, live.device_mesh, live.placements).to_local())
            else:
                live.data.copy_(whole)


def wrap_layers_the_model_has(accelerator, model) -> None:
    """Under FSDP2's transformer-based wrapping, wrap the ``_no_split_modules`` classes that ``model`` contains.

    accelerate wraps every class the model lists in ``_no_split_modules`` and stops at the first one it cannot find
    ("Could not find the transformer layer class ... in the model"). Since transformers 5.5 a vision-language model
    lists its vision tower's whole family (LLaVA with a CLIP vision tower lists ``CLIPTextEmbeddings``), so TRL's own
    ``fsdp2.yaml`` cannot train it. An explicit ``fsdp_transformer_layer_cls_to_wrap`` is left as the user wrote it.

    Args:
        accelerator: the trainer's accelerator, before it prepares the model.
        model: the model it will prepare (a PEFT model or a transformers model).
    """
    from accelerate.utils.dataclasses import get_module_class_from_name
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    policy = getattr(plugin, "auto_wrap_policy", None)
    if (not is_fsdp2(accelerator) or plugin.transformer_cls_names_to_wrap is not None
            or getattr(policy, "func", policy) is not transformer_auto_wrap_policy):
        return
    listed = list(getattr(model, "_no_split_modules", None) or [])
    present = [name for name in listed if get_module_class_from_name(model, name) is not None]
    if len(present) < len(listed):
        plugin.transformer_cls_names_to_wrap = present
        missing = ", ".join(sorted(set(listed) - set(present)))
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        notice(f"FSDP2 wraps {', '.join(sorted(present)) or 'no layer class'}: {type(base).__name__} also lists "
               f"{missing} in _no_split_modules, which it does not contain (accelerate would stop there).")
