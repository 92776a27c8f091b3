"""What trl_ext's config classes add to TRL's (each is defined beside its trainer: ``sft.SFTConfig``, ...): adapted to
the hardware before validation (``HardwareAware``, see ``runtime.adapt_to_hardware``), and the options below.

They are subclasses: every field, default and CLI flag is TRL's, and ``isinstance(cfg, trl.DPOConfig)`` holds.
Fields added, defined with their defaults in ``settings.trainer_options``: ``max_shard_size`` for trl_ext's save
path, ``save_in_background``, ``save_on_preemption`` and the checkpoint mirror's ``checkpoint_mirror``,
``mirror_storage_options``, ``mirror_grace_period`` and ``mirror_exit_grace_period`` (every config), and
``vllm_request_timeout``, ``vllm_check_sync_every`` and ``vllm_check_sync_atol`` (GRPO, RLOO).
"""

from dataclasses import dataclass

from trl_ext.engines.runtime import adapt_to_hardware
from trl_ext.errors import ConfigTypeError
from trl_ext.process import warning_filter
from trl_ext.settings import trainer_options


class HardwareAware:
    """Settings the hardware cannot honour changed, with one line, before TRL's and transformers' checks."""

    def __post_init__(self):
        warning_filter.quiet_known_noise()  # before TrainingArguments warns about TRL's own default
        adapt_to_hardware(self)
        super().__post_init__()


@dataclass
class SaveFields(trainer_options.config_fields(trainer_options.MirrorOptions),  # fields: the last base's first
                 trainer_options.config_fields(trainer_options.SaveOptions)):
    """The save path's and the checkpoint mirror's fields (every config); the mirror's address and storage options are
    checked as the config is built."""

    def __post_init__(self):
        if self.checkpoint_mirror:
            from trl_ext.mirror import options

            self.checkpoint_mirror = options.check_url(self.checkpoint_mirror)
        if self.mirror_storage_options is not None:
            from trl_ext.mirror import options

            self.mirror_storage_options = options.parse(self.mirror_storage_options)  # secrets kept out of the config
        super().__post_init__()


VLLMServerFields = trainer_options.config_fields(trainer_options.VLLMServerOptions)  # GRPO, RLOO
VLLMSyncCheckFields = trainer_options.config_fields(trainer_options.VLLMSyncCheckOptions)  # GRPO, RLOO


def from_training_arguments(args, config_class: type, trl_trainer: type):
    """The config a trainer trains with when it is given a plain ``transformers.TrainingArguments``.

    TRL's trainers that declare ``TrainingArguments`` for ``args`` (``SFTTrainer``) convert it into their config with
    ``to_dict()``; here it becomes the matching trl_ext config, a subclass of TRL's, so TRL keeps it as it is and
    trl_ext's checks see the same values TRL trains with. The others (``DPOTrainer``, ``RewardTrainer``) would fail
    on a missing field deep inside their constructor: they are refused with the fix.

    Args:
        args: the ``args`` the user passed (anything that is not ``config_class``'s TRL config).
        config_class: the trl_ext config for this trainer (``trl_ext.SFTConfig``, ...).
        trl_trainer: TRL's trainer class.

    Returns:
        ``args`` converted to ``config_class``, or ``args`` unchanged when it is not a ``TrainingArguments`` (TRL
        reports that).

    Raises:
        errors.ConfigTypeError: ``trl_trainer`` does not accept a plain ``TrainingArguments``.
    """
    import inspect

    from transformers import TrainingArguments

    if not isinstance(args, TrainingArguments):
        return args
    annotation = inspect.signature(trl_trainer.__init__).parameters["args"].annotation
    if "TrainingArguments" not in str(annotation):
        trl_config = config_class.__name__  # trl_ext's configs carry TRL's names
        raise ConfigTypeError(f"{trl_trainer.__name__} needs a {trl_config}, not a {type(args).__name__} (TRL converts "
                        f"one only for SFTTrainer): build the config as {trl_config}(output_dir=..., ...), or convert "
                        f"it with {trl_config}(**args.to_dict())")
    values = args.to_dict()
    values["hub_token"] = args.hub_token  # to_dict() hides it
    # trl_ext's own options set on the TrainingArguments object (args.checkpoint_mirror = "s3://...") come along
    values.update({name: value for name, value in vars(args).items()
                   if name in config_class.__dataclass_fields__ and name not in values})
    return config_class(**values)
