"""trl_ext: TRL's SFT, reward, DPO, KTO, GRPO and RLOO trainers, minus the failures that cost days at scale.

    from trl_ext import SFTTrainer, SFTConfig   # instead of: from trl import SFTTrainer, SFTConfig
"""

from trl_ext.process.warning_filter import quiet_known_logs

quiet_known_logs()  # before trl imports peft, which imports bitsandbytes (see process/warning_filter.py)

from trl_ext.placement.orchestrators import torchrun  # noqa: E402
from trl_ext.process import ranks  # noqa: E402

# process/ sits below placement/: before a process group exists, its rank is the one reader of launchers' variables'
ranks.launched_by(torchrun.launched_rank, torchrun.launched_world_size)

from typing import TYPE_CHECKING  # noqa: E402

from trl_ext import trainers  # noqa: E402  (the registration only: no trainer, no TRL)

if TYPE_CHECKING:  # what type checkers and editors see; at run time, ``__getattr__`` below imports them on first use
    from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config  # noqa: F401

    from trl_ext.trainers import *  # noqa: F403  (each trainer as its registration line in trainers/ imports it)

__version__ = "0.1.0"

_FROM_TRL = ["ModelConfig", "ScriptArguments", "TrlParser", "get_peft_config", "get_quantization_config"]
__all__ = sorted([*trainers.__all__, *_FROM_TRL], key=str.lower)


def __getattr__(name: str):
    """The trainers and TRL's helpers, imported on first use: ``import trl_ext.<module>`` alone (the Slurm node
    launcher, a process's helpers) then costs no import of TRL and transformers."""
    import importlib

    if name not in __all__:
        raise AttributeError(f"module 'trl_ext' has no attribute {name!r}")
    value = getattr(importlib.import_module("trl" if name in _FROM_TRL else "trl_ext.trainers"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
