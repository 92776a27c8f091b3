"""FSDP2: whether a run asks for it, and which layer classes it wraps.

On machines without a GPU accelerate's FSDP path runs on CPU processes with gloo (``runtime.fsdp_on_cpu``); with
``fsdp_cpu_ram_efficient_loading`` only the first process of each machine reads the weights (``rank0_loading``);
resuming reads each rank's own rows of trl_ext's Hub-format checkpoints (``resuming.fsdp2``).
"""

import contextlib
import copy
import os

from trl_ext import patches
from trl_ext.process.notices import notice


def requested(args) -> bool:
    """True if FSDP is asked for, by the training arguments or by ``accelerate launch`` (an FSDP config)."""
    return bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def is_fsdp2(accelerator) -> bool:
    """True when ``accelerator`` shards the model with FSDP2 (``fully_shard``)."""
    return bool(getattr(accelerator, "is_fsdp2", False))


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


@contextlib.contextmanager
def sharded_optimizer_states(accelerator):
    """accelerate's FSDP plugin set to ``SHARDED_STATE_DICT`` inside the block (patch ``sharded-optimizer-states``):
    optimizer states saved and loaded per rank with DCP, whatever the config says."""
    from torch.distributed.fsdp import StateDictType

    state = accelerator.state
    original = state.fsdp_plugin
    if original.state_dict_type == StateDictType.SHARDED_STATE_DICT or not patches.applies("sharded-optimizer-states"):
        yield original
        return
    sharded = copy.copy(original)
    sharded.state_dict_config = sharded.optim_state_dict_config = None
    sharded.set_state_dict_type("SHARDED_STATE_DICT")
    with patches.swapped("sharded-optimizer-states", state, "fsdp_plugin", sharded):
        yield sharded
