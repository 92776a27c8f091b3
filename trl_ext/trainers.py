"""Drop-in replacements for TRL's trainers: same constructor, same configs, same results.

Each trainer is TRL's class plus ``TrlExtMixin``, the one place that holds what trl_ext changes.
"""

import functools
import inspect

import trl

from . import checkpointing, configs
from .runtime import check_distributed_setup


class TrlExtMixin:
    """Behaviour shared by the three trainers. Overrides call ``super()`` and keep TRL's signatures."""

    _config_class: type  # the trl_ext config used when the caller passes no ``args``
    _default_run_suffix: str

    def __init__(self, *args, **kwargs):
        bound = inspect.signature(super().__init__).bind(*args, **kwargs)
        training_args = bound.arguments.get("args")
        if training_args is None:
            # Same default as TRL (``<model>-<Suffix>``), built from our hardware-aware config so it also runs on CPU.
            model = bound.arguments["model"]
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            bound.arguments["args"] = training_args = self._config_class(
                output_dir=f"{str(name).rstrip('/').split('/')[-1]}-{self._default_run_suffix}"
            )
        check_distributed_setup(training_args)
        user_reentrant = checkpointing.take_user_choice(training_args)
        super().__init__(*bound.args, **bound.kwargs)

        # Gradient checkpointing: non-reentrant unless the user or an unfixed DeepSpeed says otherwise.
        use_reentrant = checkpointing.decide(self.args, self.model, user_reentrant)
        checkpointing.apply(self.args, use_reentrant)
        if use_reentrant is not None:
            if not use_reentrant:
                checkpointing.remove_input_require_grads_hooks(self.model)  # TRL registered it for PEFT
            self.add_callback(checkpointing.CheckpointingPolicy(use_reentrant))

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        trl_base = cls.__mro__[cls.__mro__.index(TrlExtMixin) + 1]

        # Show TRL's exact signature and docs (help(), IDEs, inspect) while running the mixin's __init__.
        @functools.wraps(trl_base.__init__)
        def __init__(self, *args, **kwargs):
            TrlExtMixin.__init__(self, *args, **kwargs)

        cls.__init__ = __init__


class SFTTrainer(TrlExtMixin, trl.SFTTrainer):
    __doc__ = trl.SFTTrainer.__doc__
    _config_class, _default_run_suffix = configs.SFTConfig, "SFT"


class RewardTrainer(TrlExtMixin, trl.RewardTrainer):
    __doc__ = trl.RewardTrainer.__doc__
    _config_class, _default_run_suffix = configs.RewardConfig, "Reward"


class DPOTrainer(TrlExtMixin, trl.DPOTrainer):
    __doc__ = trl.DPOTrainer.__doc__
    _config_class, _default_run_suffix = configs.DPOConfig, "DPO"
