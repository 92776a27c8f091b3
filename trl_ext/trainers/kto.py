"""``KTOConfig`` and ``KTOTrainer``: TRL's, plus trl_ext's options and ``TrlExtMixin``; the same constructor,
fields and results."""

from dataclasses import dataclass

import trl

from trl_ext.trainers import configs
from trl_ext.trainers.mixin import TrlExtMixin


@dataclass
class KTOConfig(configs.HardwareAware, configs.SaveFields, trl.KTOConfig):
    __doc__ = trl.KTOConfig.__doc__


class KTOTrainer(TrlExtMixin, trl.KTOTrainer):
    __doc__ = trl.KTOTrainer.__doc__
    _config_class, _default_run_suffix = KTOConfig, "KTO"
    _dataset_kind = "unpaired_preference"
