"""trl_ext: TRL's SFT, reward, DPO, KTO, GRPO and RLOO trainers, minus the failures that cost days at scale.

    from trl_ext import SFTTrainer, SFTConfig   # instead of: from trl import SFTTrainer, SFTConfig
"""

from trl_ext.process.warning_filter import quiet_known_logs

quiet_known_logs()  # before trl imports peft, which imports bitsandbytes (see process/warning_filter.py)

from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config  # noqa: E402

from trl_ext import moved  # noqa: E402
from trl_ext.trainers import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
    RewardConfig,
    RewardTrainer,
    RLOOConfig,
    RLOOTrainer,
    SFTConfig,
    SFTTrainer,
    TrlExtMixin,
)

moved.register()  # import paths of earlier releases (trl_ext.saving.verify, ...)

__version__ = "0.1.0"

__all__ = [
    "DPOConfig",
    "DPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "KTOConfig",
    "KTOTrainer",
    "ModelConfig",
    "RewardConfig",
    "RewardTrainer",
    "RLOOConfig",
    "RLOOTrainer",
    "SFTConfig",
    "SFTTrainer",
    "ScriptArguments",
    "TrlExtMixin",
    "TrlParser",
    "get_peft_config",
    "get_quantization_config",
]
