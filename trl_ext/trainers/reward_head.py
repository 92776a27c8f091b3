"""The reward model's score head: one output, found from the model itself, trained and saved whole (never LoRA-wrapped).

TRL 1.16 loads reward models with ``num_labels=1`` and sets ``pad_token_id``, but a PEFT config without
``task_type="SEQ_CLS"`` (``target_modules="all-linear"``, say) LoRA-wraps the head: its own weights stay at their
random initialisation, are never saved, and reload as different random values. Here the head is found
from the loaded model, right before TRL wraps it with PEFT, and a copy of the user's PEFT config trains it through
``modules_to_save``.
"""

import contextlib
import copy

import torch

from trl_ext import patches
from trl_ext.errors import ConfigError
from trl_ext.process.notices import notice


def head_names(model: torch.nn.Module) -> list[str]:
    """Top-level modules of a sequence-classification model that hold parameters and are not its backbone
    (``base_model_prefix``): ``score`` for Llama/Qwen/Mistral/GPT-2, ``classifier`` for BERT/RoBERTa, and so on."""
    backbone = getattr(model, "base_model_prefix", None)
    return [name for name, child in model.named_children()
            if name != backbone and next(child.parameters(), None) is not None]


PEFT_SEQ_CLS_HEADS = ("classifier", "score")  # what PEFT itself adds to modules_to_save for task_type="SEQ_CLS"


def peft_config_for(model, peft_config):
    """A copy of ``peft_config`` that trains ``model``'s head whole, or the config itself if it already does."""
    heads = head_names(model)
    is_seq_cls = getattr(peft_config, "task_type", None) == "SEQ_CLS"
    saved_whole = set(getattr(peft_config, "modules_to_save", None) or [])
    saved_whole |= set(PEFT_SEQ_CLS_HEADS if is_seq_cls else ())
    targets = getattr(peft_config, "target_modules", None)
    targeted = sorted(set(targets) & set(heads)) if isinstance(targets, (list, set, tuple)) else []
    missing = [h for h in heads if h not in saved_whole]
    if is_seq_cls and not missing and not targeted:
        return peft_config

    config, changes = copy.deepcopy(peft_config), []
    if not is_seq_cls:
        config.task_type = "SEQ_CLS"  # saved in adapter_config.json: the adapter declares a sequence classifier
        changes.append("task_type='SEQ_CLS'")
    if missing and hasattr(config, "modules_to_save"):
        config.modules_to_save = [*(config.modules_to_save or []), *missing]
        changes.append(f"modules_to_save += {missing}")
    if targeted:
        config.target_modules = type(targets)(t for t in targets if t not in heads)
        changes.append(f"target_modules -= {targeted}")
    notice(f"RewardTrainer: the reward head {heads} is trained and saved whole, not LoRA-wrapped or left untrained "
           f"({'; '.join(changes)}, on a copy of your peft_config).")
    return config


@contextlib.contextmanager
def head_trained_whole(trl_module):
    """While TRL's RewardTrainer builds the model, route its ``get_peft_model`` call through ``peft_config_for``.

    TRL 1.16 offers no hook between loading the model and wrapping it with PEFT, and the head can only be found
    once the model exists (a model id is loaded inside TRL's constructor).
    """
    original = trl_module.get_peft_model

    def get_peft_model(model, peft_config, *args, **kwargs):
        return original(model, peft_config_for(model, peft_config), *args, **kwargs)

    with patches.swapped("reward-head-peft-config", trl_module, "get_peft_model", get_peft_model):
        yield


def allow_new_head(model_id: str, args) -> None:
    """A model id whose checkpoint already has a classification head of another size (a 2- or 3-label classifier)
    gets a new one-output head, with a notice, instead of transformers' size-mismatch error."""
    from transformers import AutoConfig

    kwargs = args.model_init_kwargs or {}
    try:
        config = AutoConfig.from_pretrained(model_id, revision=kwargs.get("revision"),
                                            trust_remote_code=args.trust_remote_code)
    except Exception:  # noqa: BLE001 - transformers reports an unreadable model when it loads it
        return
    is_classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    if is_classifier and config.num_labels != 1:
        args.model_init_kwargs = {**kwargs, "ignore_mismatched_sizes": True}
        notice(f"RewardTrainer: {model_id} has a {config.num_labels}-output classification head; a reward model has "
               "one output, so the head is re-initialised.")


def check(model) -> None:
    """After construction: the head has one output and, under PEFT, is trained whole. Clear errors otherwise."""
    from accelerate.utils import is_peft_model

    base = model.get_base_model() if is_peft_model(model) else model
    if getattr(base.config, "num_labels", 1) != 1:
        raise ConfigError(f"The reward model has num_labels={base.config.num_labels}; it must be 1 (one score).")
    if not is_peft_model(model):
        return
    wrapped = [name for name in head_names(base)
               if any(".lora_" in n or n.startswith("lora_") for n, _ in getattr(base, name).named_parameters())]
    if wrapped:
        raise ConfigError(
            f"The PeftModel you passed LoRA-wraps the reward head {wrapped}: its own weights would stay random and "
            f"never be saved. Pass the base model with peft_config=... instead, or build the PeftModel with "
            f"LoraConfig(task_type='SEQ_CLS', modules_to_save={wrapped})."
        )
