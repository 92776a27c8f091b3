"""The trainers: TRL's classes plus ``TrlExtMixin``, and the configs they take."""

from trl_ext.trainers.configs import DPOConfig, GRPOConfig, KTOConfig, RewardConfig, RLOOConfig, SFTConfig
from trl_ext.trainers.mixin import TrlExtMixin
from trl_ext.trainers.trl_trainers import (
    DPOTrainer,
    GRPOTrainer,
    KTOTrainer,
    RewardTrainer,
    RLOOTrainer,
    SFTTrainer,
)

__all__ = ["DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "KTOConfig", "KTOTrainer", "RLOOConfig",
           "RLOOTrainer", "RewardConfig", "RewardTrainer", "SFTConfig", "SFTTrainer", "TrlExtMixin"]
