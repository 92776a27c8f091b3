"""Drop-in replacements for TRL's trainers: each is TRL's class plus ``TrlExtMixin``, with the same constructor,
configs and results."""

import inspect
import sys

import trl

from trl_ext import patches
from trl_ext.data import model_paths
from trl_ext.trainers import configs, reward_head, weight_sync
from trl_ext.trainers.mixin import TrlExtMixin


class SFTTrainer(TrlExtMixin, trl.SFTTrainer):
    __doc__ = trl.SFTTrainer.__doc__
    _config_class, _default_run_suffix = configs.SFTConfig, "SFT"
    _dataset_kind = "sft"


class RewardTrainer(TrlExtMixin, trl.RewardTrainer):
    __doc__ = trl.RewardTrainer.__doc__
    _config_class, _default_run_suffix = configs.RewardConfig, "Reward"
    _dataset_kind = "preference"
    _fused_lm_head = False

    def _around_trl_init(self, bound):
        # One output, and a head trained and saved whole under PEFT (see reward_head).
        if isinstance(bound.arguments["model"], str):
            reward_head.allow_new_head(bound.arguments["model"], bound.arguments["args"])
        return reward_head.head_trained_whole(sys.modules[self._trl_class.__module__])

    def _after_trl_init(self):
        reward_head.check(self.model)


class DPOTrainer(TrlExtMixin, trl.DPOTrainer):
    __doc__ = trl.DPOTrainer.__doc__
    _config_class, _default_run_suffix = configs.DPOConfig, "DPO"
    _dataset_kind = "preference"


class KTOTrainer(TrlExtMixin, trl.KTOTrainer):
    __doc__ = trl.KTOTrainer.__doc__
    _config_class, _default_run_suffix = configs.KTOConfig, "KTO"
    _dataset_kind = "unpaired_preference"


def _bounded_weight_sync(trl_module, request_timeout: float = configs.VLLM_REQUEST_TIMEOUT):
    """While TRL's constructor runs, it builds our ``VLLMGeneration`` (the bounded, Hub-named weight sync, and bounded
    waits on a vLLM server) instead of its own: TRL creates the object inline in ``__init__`` and offers no hook to
    choose its class."""
    generation = weight_sync.BoundedVLLMGeneration.with_timeout(request_timeout)
    return patches.swapped("bounded-weight-sync", trl_module, "VLLMGeneration", generation)


class _OnlineRLMixin:
    """GRPO and RLOO: prompt-only datasets, and the vLLM weight sync that never gathers the whole model."""

    def _check_input(self, bound: inspect.BoundArguments) -> None:
        # Rows are prompts (plus reward-function columns): input_checks' SFT/preference formats do not apply.
        model_paths.check_model_path(bound.arguments.get("model"))

    def _around_trl_init(self, bound: inspect.BoundArguments):
        timeout = getattr(bound.arguments.get("args"), "vllm_request_timeout", configs.VLLM_REQUEST_TIMEOUT)
        return _bounded_weight_sync(sys.modules[self._trl_class.__module__], timeout)

    def _after_trl_init(self) -> None:
        super()._after_trl_init()
        generation = getattr(self, "vllm_generation", None)
        if isinstance(generation, weight_sync.BoundedVLLMGeneration):  # a server failure names the step it stopped
            generation.current_step = lambda: self.state.global_step + 1


class GRPOTrainer(_OnlineRLMixin, TrlExtMixin, trl.GRPOTrainer):
    __doc__ = trl.GRPOTrainer.__doc__
    _config_class, _default_run_suffix = configs.GRPOConfig, "GRPO"


class RLOOTrainer(_OnlineRLMixin, TrlExtMixin, trl.RLOOTrainer):
    __doc__ = trl.RLOOTrainer.__doc__
    _config_class, _default_run_suffix = configs.RLOOConfig, "RLOO"
