"""TRL's config classes, adapted to the hardware before validation (see ``runtime.adapt_to_hardware``).

They are subclasses: every field, default and CLI flag is TRL's, and ``isinstance(cfg, trl.DPOConfig)`` holds.
"""

from dataclasses import dataclass

import trl

from .runtime import adapt_to_hardware


class _HardwareAware:
    def __post_init__(self):
        adapt_to_hardware(self)
        super().__post_init__()


@dataclass
class SFTConfig(_HardwareAware, trl.SFTConfig):
    __doc__ = trl.SFTConfig.__doc__


@dataclass
class RewardConfig(_HardwareAware, trl.RewardConfig):
    __doc__ = trl.RewardConfig.__doc__


@dataclass
class DPOConfig(_HardwareAware, trl.DPOConfig):
    __doc__ = trl.DPOConfig.__doc__
