"""``RewardConfig`` and ``RewardTrainer``: TRL's, plus trl_ext's options and ``TrlExtMixin``; the same constructor,
fields and results."""

import sys
from dataclasses import dataclass

import trl

from trl_ext.trainers import configs, reward_head
from trl_ext.trainers.mixin import TrlExtMixin


@dataclass
class RewardConfig(configs.HardwareAware, configs.SaveFields, trl.RewardConfig):
    __doc__ = trl.RewardConfig.__doc__


class RewardTrainer(TrlExtMixin, trl.RewardTrainer):
    __doc__ = trl.RewardTrainer.__doc__
    _config_class, _default_run_suffix = RewardConfig, "Reward"
    _dataset_kind = "preference"
    _fused_lm_head = False

    def _around_trl_init(self, bound):
        # One output, and a head trained and saved whole under PEFT (see reward_head).
        if isinstance(bound.arguments["model"], str):
            reward_head.allow_new_head(bound.arguments["model"], bound.arguments["args"])
        return reward_head.head_trained_whole(sys.modules[self._trl_class.__module__])

    def _after_trl_init(self):
        reward_head.check(self.model)
