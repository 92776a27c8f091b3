"""trl_ext: TRL's SFT, reward and DPO trainers, minus the failures that cost days at scale.

    from trl_ext import SFTTrainer, SFTConfig   # instead of: from trl import SFTTrainer, SFTConfig
"""

from trl import ModelConfig, ScriptArguments, TrlParser

from .configs import DPOConfig, RewardConfig, SFTConfig
from .trainers import DPOTrainer, RewardTrainer, SFTTrainer, TrlExtMixin

__version__ = "0.1.0"

__all__ = [
    "DPOConfig",
    "DPOTrainer",
    "ModelConfig",
    "RewardConfig",
    "RewardTrainer",
    "SFTConfig",
    "SFTTrainer",
    "ScriptArguments",
    "TrlExtMixin",
    "TrlParser",
]
