"""The trainers: TRL's classes plus ``TrlExtMixin``, and the configs they take. Each trainer is imported on first use,
with only its own TRL module: ``from trl_ext import DPOTrainer`` imports TRL's DPO trainer, not its GRPO trainer and
vLLM client."""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trl_ext.trainers.dpo import DPOConfig, DPOTrainer
    from trl_ext.trainers.kto import KTOConfig, KTOTrainer
    from trl_ext.trainers.mixin import TrlExtMixin
    from trl_ext.trainers.online import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
    from trl_ext.trainers.reward import RewardConfig, RewardTrainer
    from trl_ext.trainers.sft import SFTConfig, SFTTrainer

# name -> the module that defines it: each config beside its trainer
MODULES = {"TrlExtMixin": "mixin", **{f"{name}{kind}": module for name, module in (
    ("SFT", "sft"), ("Reward", "reward"), ("DPO", "dpo"), ("KTO", "kto"), ("GRPO", "online"), ("RLOO", "online"))
    for kind in ("Config", "Trainer")}}

__all__ = ["DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "KTOConfig", "KTOTrainer", "RLOOConfig",
           "RLOOTrainer", "RewardConfig", "RewardTrainer", "SFTConfig", "SFTTrainer", "TrlExtMixin"]


def __getattr__(name: str):
    if name not in MODULES:
        raise AttributeError(f"module 'trl_ext.trainers' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"trl_ext.trainers.{MODULES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
