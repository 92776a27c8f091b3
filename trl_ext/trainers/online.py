"""``GRPOConfig``, ``GRPOTrainer``, ``RLOOConfig`` and ``RLOOTrainer``: TRL's online RL trainers plus ``TrlExtMixin``,
with prompt-only datasets and the vLLM weight sync that never gathers the whole model (``weight_sync``), bounded waits
on a vLLM server included."""

import inspect
import sys
from dataclasses import dataclass

import trl

from trl_ext import patches
from trl_ext.data import model_paths
from trl_ext.settings import trainer_options
from trl_ext.trainers import configs, vllm_checks, weight_sync
from trl_ext.trainers.mixin import TrlExtMixin


def _bounded_weight_sync(trl_module, request_timeout: float, check_every: int, check_atol: float):
    """While TRL's constructor runs, it builds our ``VLLMGeneration`` (the bounded, Hub-named weight sync, proven in
    colocate mode, and bounded waits on a vLLM server) instead of its own: TRL creates the object inline in
    ``__init__`` and offers no hook to choose its class."""
    generation = weight_sync.BoundedVLLMGeneration.with_timeout(request_timeout, check_every, check_atol)
    return patches.swapped("bounded-weight-sync", trl_module, "VLLMGeneration", generation)


class _OnlineRLMixin:
    """GRPO and RLOO: prompt-only datasets, and the vLLM weight sync that never gathers the whole model."""

    def _check_input(self, bound: inspect.BoundArguments) -> None:
        # Rows are prompts (plus reward-function columns): input_checks' SFT/preference formats do not apply.
        model_paths.check_model_path(bound.arguments.get("model"))
        vllm_checks.check(bound.arguments.get("args"), bound.arguments.get("model"),
                          peft_config=bound.arguments.get("peft_config"))

    def _around_trl_init(self, bound: inspect.BoundArguments):
        args = bound.arguments.get("args")  # read now: TRL builds its vLLM client in its constructor
        server, check = trainer_options.VLLMServerOptions.of(args), trainer_options.VLLMSyncCheckOptions.of(args)
        return _bounded_weight_sync(sys.modules[self._trl_class.__module__], server.vllm_request_timeout,
                                    check.vllm_check_sync_every, check.vllm_check_sync_atol)

    def _after_trl_init(self) -> None:
        super()._after_trl_init()
        generation = getattr(self, "vllm_generation", None)
        if isinstance(generation, weight_sync.BoundedVLLMGeneration):  # a server failure names the step it stopped
            generation.current_step = lambda: self.state.global_step + 1
            # logged beside TRL's metrics: 1 where the step's sync was proven, the mean over a logging interval
            generation.on_sync = lambda checked: self._metrics["train"]["sync/checked"].append(float(checked))


@dataclass
class GRPOConfig(configs.HardwareAware, configs.SaveFields, configs.VLLMServerFields, configs.VLLMSyncCheckFields,
                 trl.GRPOConfig):
    __doc__ = trl.GRPOConfig.__doc__


class GRPOTrainer(_OnlineRLMixin, TrlExtMixin, trl.GRPOTrainer):
    __doc__ = trl.GRPOTrainer.__doc__
    _config_class, _default_run_suffix = GRPOConfig, "GRPO"


@dataclass
class RLOOConfig(configs.HardwareAware, configs.SaveFields, configs.VLLMServerFields, configs.VLLMSyncCheckFields,
                 trl.RLOOConfig):
    __doc__ = trl.RLOOConfig.__doc__


class RLOOTrainer(_OnlineRLMixin, TrlExtMixin, trl.RLOOTrainer):
    __doc__ = trl.RLOOTrainer.__doc__
    _config_class, _default_run_suffix = RLOOConfig, "RLOO"
