"""What ``from_pretrained`` and serving engines read beside the weights, written as ``save_pretrained`` writes it: the
index, the model's config (its own class in ``architectures``, not FSDP2's wrapper) and generation config, or the
adapter's config; the tokenizer or processor; the training arguments."""

import contextlib
import copy
import json
from pathlib import Path

import torch
from accelerate.utils import is_peft_model

from trl_ext.files import hub_names
from trl_ext.files.shards import index_json


def _adapter_config(model, peft_config):
    config = copy.deepcopy(peft_config)
    base = model.get_base_model()
    config.base_model_name_or_path = config.base_model_name_or_path or getattr(base, "name_or_path", None)
    config.inference_mode = True
    for field in ("target_modules", "modules_to_save"):  # sets: written sorted, the same on every run
        if isinstance(getattr(config, field, None), set):
            setattr(config, field, sorted(getattr(config, field)))
    auto_mapping = None
    if config.task_type is None:  # lets AutoPeftModel find the base class, as PEFT records it
        base_class = hub_names.model_class(base)
        auto_mapping = {"base_model_class": base_class.__name__, "parent_library": base_class.__module__}
    return config, auto_mapping


def write_metadata(model, directory: Path, weight_sets, processing_class=None, training_args=None) -> None:
    """Write everything but the weights into ``directory``.

    Args:
        model: the model saved (a transformers model or a PEFT model around one, possibly sharded).
        directory: the save's staging directory.
        weight_sets: the save's plan (``plan.WeightSet``s): an index for each set of several files, an adapter config
            for each adapter.
        processing_class: a tokenizer or processor to save beside the weights (optional).
        training_args: saved as ``training_args.bin`` (optional).
    """
    for ws in weight_sets:
        target = directory / ws.subdir
        if len(ws.plan) > 1:
            (target / "model.safetensors.index.json").write_text(json.dumps(index_json(ws.plan), indent=2))
        if ws.peft_config is not None:
            config, auto_mapping = _adapter_config(model, ws.peft_config)
            config.save_pretrained(str(target), auto_mapping_dict=auto_mapping)
    if is_peft_model(model):
        with contextlib.suppress(Exception):  # the model card is a nicety; never fail a save over it
            model.create_or_update_model_card(str(directory))
    else:
        config = copy.deepcopy(model.config)
        config.architectures = [hub_names.model_class(model).__name__]
        config.dtype = str(model.dtype).split(".")[1]
        if getattr(model, "_auto_class", None) is not None:  # remote code: copied beside it, as save_pretrained does
            from transformers.dynamic_module_utils import custom_object_save

            custom_object_save(model, str(directory), config=config)
        config.save_pretrained(str(directory))
        if model.can_generate() and model.generation_config is not None:
            model.generation_config.save_pretrained(str(directory))
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(str(directory))
    if training_args is not None:
        torch.save(training_args, directory / "training_args.bin")
