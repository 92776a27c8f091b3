"""``fsdp_cpu_ram_efficient_loading`` under FSDP2 as it says: only the first process of each machine reads the
weights; the others read the files' headers and receive their shards from rank 0 (accelerate's broadcast)."""

import contextlib
import dataclasses
import os

import torch

from trl_ext import patches
from trl_ext.engines.fsdp import is_fsdp2, wrap_layers_the_model_has


def _reads_weights() -> bool:
    """False on the processes that ``fsdp_cpu_ram_efficient_loading`` keeps from reading weights under FSDP2 (all but
    the first of each machine, as transformers decides it); they get their shards from rank 0 when sharded."""
    from transformers.integrations import is_fsdp_enabled

    try:
        from transformers.distributed.utils import is_local_dist_rank_0
    except ImportError:  # transformers before the function moved (5.10 has it in modeling_utils)
        from transformers.modeling_utils import is_local_dist_rank_0

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
