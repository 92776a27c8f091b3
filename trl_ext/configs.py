"""TRL's config classes, adapted to the hardware before validation (see ``runtime.adapt_to_hardware``).

They are subclasses: every field, default and CLI flag is TRL's, and ``isinstance(cfg, trl.DPOConfig)`` holds.
One field is added: ``max_shard_size`` for trl_ext's save path.
"""

from dataclasses import dataclass, field

import trl

from .runtime import adapt_to_hardware


class _HardwareAware:
    def __post_init__(self):
        adapt_to_hardware(self)
        super().__post_init__()


@dataclass
class _SaveOptions:
    max_shard_size: str = field(
        default="50GB",
        metadata={"help": "Largest safetensors file a full-model save writes (e.g. '5GB'). Saving streams tensor by "
                          "tensor, so this does not change memory use."},
    )


@dataclass
class SFTConfig(_HardwareAware, _SaveOptions, trl.SFTConfig):
    __doc__ = trl.SFTConfig.__doc__


@dataclass
class RewardConfig(_HardwareAware, _SaveOptions, trl.RewardConfig):
    __doc__ = trl.RewardConfig.__doc__


@dataclass
class DPOConfig(_HardwareAware, _SaveOptions, trl.DPOConfig):
    __doc__ = trl.DPOConfig.__doc__


@dataclass
class GRPOConfig(_HardwareAware, _SaveOptions, trl.GRPOConfig):
    __doc__ = trl.GRPOConfig.__doc__


@dataclass
class RLOOConfig(_HardwareAware, _SaveOptions, trl.RLOOConfig):
    __doc__ = trl.RLOOConfig.__doc__
