"""Gradient-checkpointing policy: ``use_reentrant=False`` everywhere, PEFT + ZeRO-3 included.

Why: non-reentrant checkpointing is PyTorch's recommendation (no input-require-grads hook, selective checkpointing,
``torch.compile``). TRL 1.16 forces reentrant for PEFT + ZeRO-3 because older DeepSpeed re-partitioned frozen
parameters during the recompute ("CheckpointError: Recomputed values ... have different metadata"). DeepSpeed
>= 0.19.3 (PR #8148) keeps them gathered, so we only fall back where that fix is missing.
That fix hands each frozen parameter a recompute gathers to the backward submodule running at the time (a lora_B)
and frees it when that one finishes, so every frozen weight is all-gathered a second time by its own module's
backward (0.93x the model per step). ``keep_recomputed_params_for_their_module`` (below) hands it instead to the
innermost running backward submodule that contains it, so non-reentrant gathers what reentrant gathers
(bench/RESULTS.md, "Non-reentrant checkpointing without the extra all-gather").
"""

import functools
import inspect
import os

from transformers import TrainerCallback
from transformers.modeling_layers import GradientCheckpointingLayer

from trl_ext import patches
from trl_ext.engines import fsdp
from trl_ext.errors import SetupError
from trl_ext.process.notices import notice

DEEPSPEED_FIX_VERSION = "0.19.3"


@functools.cache
def deepspeed_keeps_frozen_params_on_recompute() -> bool:
    """Capability check for DeepSpeed PR #8148: the ZeRO-3 coordinator tracks recompute-owned parameters."""
    try:
        import deepspeed
        from deepspeed.runtime.zero import partitioned_param_coordinator
    except ImportError:
        return True  # no DeepSpeed, no ZeRO-3 problem
    try:
        # The fix keeps recompute-owned params in ``ds_recompute_parameters`` until the backward releases them.
        return "ds_recompute_parameters" in inspect.getsource(partitioned_param_coordinator)
    except (OSError, TypeError):  # no source shipped: fall back to the version
        from packaging.version import Version

        return Version(deepspeed.__version__) >= Version(DEEPSPEED_FIX_VERSION)


def checkpointing_on(args) -> bool:
    """Whether the config turns checkpointing on: ``activation_checkpointing`` from transformers 5.23, the older
    ``gradient_checkpointing`` before it (5.23 keeps that name as an alias, copied at init)."""
    return bool(getattr(args, "activation_checkpointing", getattr(args, "gradient_checkpointing", False)))


def checkpointing_kwargs(args) -> dict | None:
    """``activation_checkpointing_kwargs``, or ``gradient_checkpointing_kwargs`` before transformers 5.23."""
    return getattr(args, "activation_checkpointing_kwargs", getattr(args, "gradient_checkpointing_kwargs", None))


def fsdp_recomputes(args) -> bool:
    """True when FSDP's own activation checkpointing is on (``fsdp_activation_checkpointing`` in the accelerate
    config, or ``fsdp_config["activation_checkpointing"]``). It wraps each decoder layer non-reentrantly; ours is then
    turned off, with a notice, so that no layer is checkpointed twice (Trainer would refuse the pair outright)."""
    from accelerate.utils import str_to_bool

    from_launcher = str_to_bool(os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false"))
    from_args = bool((getattr(args, "fsdp_config", None) or {}).get("activation_checkpointing"))
    if not (from_launcher or from_args) or not fsdp.requested(args):
        return False
    if checkpointing_on(args):
        args.activation_checkpointing = args.gradient_checkpointing = False
        notice("FSDP's activation checkpointing is on (fsdp_activation_checkpointing): it checkpoints every decoder "
               "layer, non-reentrant, so gradient_checkpointing is turned off to avoid checkpointing twice.")
    return True


def fsdp_checkpointed_layers(model) -> tuple[int, int]:
    """``(decoder layers inside a non-reentrant CheckpointWrapper, decoder layers)``, as FSDP's checkpointing left
    them (the wrapped layers all of them where the release moved torch's wrapper: nothing to check)."""
    wrapped = non_reentrant_checkpoint_wrapped(model)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if wrapped is None:
        return len(layers), len(layers)
    return sum(id(m) in wrapped for m in layers), len(layers)


class FsdpCheckpointingCheck(TrainerCallback):
    """At train start: every decoder layer is checkpointed once, by FSDP, non-reentrant."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        wrapped, layers = fsdp_checkpointed_layers(model)
        if not layers or wrapped != layers or layer_settings(model):
            raise SetupError(
                f"FSDP activation checkpointing should wrap every decoder layer non-reentrantly, once: {wrapped} of "
                f"{layers} layers are wrapped, {len(layer_settings(model))} also use transformers' checkpointing.")


def take_user_choice(args):
    """Read (and hide from TRL, which would warn and override it) the user's explicit ``use_reentrant``.

    Call before TRL's ``__init__``. Returns True/False for an explicit choice, None when unset.
    """
    kwargs = checkpointing_kwargs(args)
    if not checkpointing_on(args) or not kwargs or "use_reentrant" not in kwargs:
        return None
    choice = bool(kwargs["use_reentrant"])
    if not choice:  # TRL warns "forced to True" for an explicit False under PEFT + ZeRO-3; we decide instead
        args.activation_checkpointing_kwargs = args.gradient_checkpointing_kwargs = {
            k: v for k, v in kwargs.items() if k != "use_reentrant"
        }
    return choice


def decide(args, model, user_choice):
    """The ``use_reentrant`` value training will use, or None when checkpointing is off."""
    if not checkpointing_on(args):
        return None
    if user_choice is not None:
        return user_choice
    zero3 = args.deepspeed_plugin is not None and args.deepspeed_plugin.zero_stage == 3
    has_frozen = any(not p.requires_grad for p in model.parameters())
    if zero3 and has_frozen and not deepspeed_keeps_frozen_params_on_recompute():
        import deepspeed

        notice(
            f"DeepSpeed {deepspeed.__version__} cannot recompute frozen ZeRO-3 parameters with non-reentrant "
            f"checkpointing: using use_reentrant=True. Upgrade to deepspeed>={DEEPSPEED_FIX_VERSION} to remove this."
        )
        return True
    return False


def apply(args, use_reentrant) -> None:
    """Write the decision where transformers reads it when it enables checkpointing at train time."""
    if use_reentrant is None:
        return
    kwargs = {**(checkpointing_kwargs(args) or {}), "use_reentrant": use_reentrant}
    args.activation_checkpointing_kwargs = args.gradient_checkpointing_kwargs = kwargs


def remove_input_require_grads_hooks(model) -> None:
    """Non-reentrant checkpointing needs no grad-requiring inputs; the hook only costs memory.

    transformers re-registers the hook each time checkpointing is enabled, and TRL's DPO re-enables it every step
    (around the reference forward), so the model's own method becomes a no-op too (patch ``no-input-require-grads``).
    """
    drop_input_require_grads(model)


def layer_settings(model) -> dict[str, object]:
    """``{layer name: use_reentrant}`` for every layer that checkpoints, as its checkpoint function will call it."""
    settings = {}
    for name, module in model.named_modules():
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing:
            func = getattr(module, "_gradient_checkpointing_func", None)
            settings[name] = func.keywords.get("use_reentrant") if isinstance(func, functools.partial) else None
    return settings


def zero3_offload(optimizer):
    """DeepSpeed's ZeRO-3 parameter offload (which holds the parameter coordinator) behind accelerate's optimizer
    wrapper, or None outside ZeRO-3."""
    for _ in range(3):
        offload = getattr(optimizer, "parameter_offload", None)
        if offload is not None:
            return offload
        optimizer = getattr(optimizer, "optimizer", None)
    return None


class CheckpointingPolicy(TrainerCallback):
    """At train start, after transformers enabled checkpointing: drop the hook, keep ZeRO-3's recomputed frozen
    weights for their own backward, and prove every layer got the setting."""

    def __init__(self, use_reentrant: bool):
        self.use_reentrant = use_reentrant

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None or not checkpointing_on(args):
            return
        if not self.use_reentrant:
            remove_input_require_grads_hooks(model)
            offload = zero3_offload(kwargs.get("optimizer"))
            if offload is not None and deepspeed_keeps_frozen_params_on_recompute():
                keep_recomputed_params_for_their_module(offload.module, offload.get_param_coordinator())
        settings = layer_settings(model)
        wrong = sorted(name for name, value in settings.items() if value is not self.use_reentrant)
        if not settings or wrong:
            raise SetupError(
                f"Gradient checkpointing should run with use_reentrant={self.use_reentrant}, but "
                + (f"{len(wrong)} layers use another setting (e.g. {wrong[0]})." if wrong else "no layer checkpoints.")
                + " Something overrode `activation_checkpointing_kwargs` after the trainer was built."
            )


def _skip_input_require_grads():
    """Stands in for ``enable_input_require_grads`` on a model trained with non-reentrant checkpointing."""


def drop_input_require_grads(model) -> None:
    """Remove the input-require-grads hook from every transformers model inside ``model``, and keep it from coming
    back: the model's own ``enable_input_require_grads`` becomes a no-op (patch ``no-input-require-grads``)."""
    from transformers import PreTrainedModel

    if not patches.applies("no-input-require-grads"):
        return
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module.disable_input_require_grads()
            module.enable_input_require_grads = _skip_input_require_grads


def non_reentrant_checkpoint_wrapped(model) -> set[int] | None:
    """The ``id`` of each module of ``model`` that torch's ``CheckpointWrapper`` wraps non-reentrantly (FSDP's
    activation checkpointing; patch ``checkpoint-wrapper``), or None where the release moved the wrapper."""
    if not patches.applies("checkpoint-wrapper"):
        return None
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, CheckpointWrapper

    return {id(m._checkpoint_wrapped_module) for m in model.modules()
            if isinstance(m, CheckpointWrapper) and m.checkpoint_impl == CheckpointImpl.NO_REENTRANT}


def _update_recompute_parameters(sub_module, param) -> None:
    """DeepSpeed's ``update_recompute_parameters`` with the owner moved: the innermost backward submodule running that
    contains the parameter's module (its layer, its MLP), else DeepSpeed's choice."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator_module

    owners = getattr(param, "_trl_ext_recompute_owners", None)  # (containing modules' ds_ids, active backward ones)
    if owners is not None:
        chain, active = owners
        sub_module = next((active[ds_id] for ds_id in chain if ds_id in active), sub_module)
    coordinator_module._deepspeed_update_recompute_parameters(sub_module, param)


def keep_recomputed_params_for_their_module(module, coordinator) -> bool:
    """Under ZeRO-3, keep each frozen parameter a non-reentrant recompute gathers until the backward of a module that
    contains it has ended, as reentrant checkpointing does (patch ``recompute-owner``).

    Only the owner of the release changes: it is still a backward submodule running at the recompute, so DeepSpeed
    releases it when that submodule's backward ends, or at the end of the backward if its hook never fires.

    Args:
        module: the model DeepSpeed's engine wraps (``engine.module``).
        coordinator: the engine's ``PartitionedParameterCoordinator``.

    Returns:
        Whether the patch is in place for ``module``.
    """
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator_module

    active = getattr(coordinator, "_PartitionedParameterCoordinator__active_backward_submodules", None)
    if not isinstance(active, dict) or not patches.applies("recompute-owner"):
        return False
    stack, seen = [(module, ())], set()
    while stack:  # each frozen parameter learns its modules, innermost first (a tied one: the first that holds it)
        current, outer = stack.pop()
        chain = (current.ds_id, *outer) if hasattr(current, "ds_id") else outer
        for param in current.parameters(recurse=False):
            if not param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                param._trl_ext_recompute_owners = (chain, active)  # this engine's, if an earlier one trained it
        stack.extend((child, chain) for child in current.children())
    if coordinator_module.update_recompute_parameters is not _update_recompute_parameters:
        coordinator_module._deepspeed_update_recompute_parameters = coordinator_module.update_recompute_parameters
        coordinator_module.update_recompute_parameters = _update_recompute_parameters
    return True
