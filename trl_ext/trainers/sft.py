"""``SFTConfig`` and ``SFTTrainer``: TRL's, plus trl_ext's options and ``TrlExtMixin``; the same constructor,
fields and results."""

from dataclasses import dataclass

import trl

from trl_ext.trainers import configs
from trl_ext.trainers.mixin import TrlExtMixin


@dataclass
class SFTConfig(configs.HardwareAware, configs.SaveFields, trl.SFTConfig):
    __doc__ = trl.SFTConfig.__doc__


class SFTTrainer(TrlExtMixin, trl.SFTTrainer):
    __doc__ = trl.SFTTrainer.__doc__
    _config_class, _default_run_suffix = SFTConfig, "SFT"
    _dataset_kind = "sft"
