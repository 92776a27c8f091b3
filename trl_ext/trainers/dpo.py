"""``DPOConfig`` and ``DPOTrainer``: TRL's, plus trl_ext's options and ``TrlExtMixin``; the same constructor,
fields and results."""

from dataclasses import dataclass

import trl

from trl_ext.trainers import configs
from trl_ext.trainers.mixin import TrlExtMixin


@dataclass
class DPOConfig(configs.HardwareAware, configs.SaveFields, trl.DPOConfig):
    __doc__ = trl.DPOConfig.__doc__


class DPOTrainer(TrlExtMixin, trl.DPOTrainer):
    __doc__ = trl.DPOTrainer.__doc__
    _config_class, _default_run_suffix = DPOConfig, "DPO"
    _dataset_kind = "preference"
