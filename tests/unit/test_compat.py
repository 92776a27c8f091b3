"""The fallbacks for older TRL releases (trl_ext.trainers.compat), decided from the version they are told."""

import pytest
import torch
from packaging.version import Version

import trl_ext
from trl_ext.trainers import compat


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)


def _lora_init(trl_version: str, rng_before: int) -> torch.Tensor:
    """The LoRA A weights PEFT draws right after ``seed_before_model``, from a global RNG left at ``rng_before``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(rng_before)  # whatever ran before the trainer
    args = trl_ext.SFTConfig(output_dir="unused", seed=7, report_to="none")
    config = LoraConfig(r=2, target_modules=["lin"])
    compat.seed_before_model(args, config, "SFTTrainer", Version(trl_version))
    model = get_peft_model(_Net(), config)
    return next(p for n, p in model.named_parameters() if "lora_A" in n).detach().clone()


def test_trl_before_1_15_gets_the_seed_trl_1_15_sets(caplog):
    with caplog.at_level("WARNING", logger="trl_ext"):
        first, second = _lora_init("1.14.0", 1), _lora_init("1.14.2", 2)
    assert torch.equal(first, second)  # same seed, same LoRA init, whatever ran before
    assert "does not seed before creating the PEFT adapter (fixed in trl 1.15)" in caplog.text


def test_trl_1_15_and_later_seed_themselves(caplog):
    with caplog.at_level("WARNING", logger="trl_ext"):
        assert not torch.equal(_lora_init("1.15.0", 1), _lora_init("1.16.0", 2))  # untouched: TRL seeds, not us
    assert "seed" not in caplog.text


def test_trl_1_14_reward_trainer_seeds_itself(caplog):
    torch.manual_seed(1)
    with caplog.at_level("WARNING", logger="trl_ext"):
        compat.seed_before_model(trl_ext.RewardConfig(output_dir="unused", seed=7, report_to="none"), object(),
                                 "RewardTrainer", Version("1.14.2"))
    assert "seed" not in caplog.text
    assert torch.initial_seed() == 1  # the global generator was left alone


@pytest.mark.parametrize("version", ["1.14.2", "1.16.0"])
def test_fused_loss_check_passes_outside_trl_1_15(version):
    args = trl_ext.SFTConfig(output_dir="unused", report_to="none")
    compat.check_fused_loss_runs_here(args, "SFTTrainer", Version(version), has_gpu=False)


def test_trl_1_15_without_a_gpu_is_refused_in_one_line():
    args = trl_ext.SFTConfig(output_dir="unused", report_to="none")
    with pytest.raises(RuntimeError) as error:
        compat.check_fused_loss_runs_here(args, "DPOTrainer", Version("1.15.0"), has_gpu=False)
    message = str(error.value)
    assert "\n" not in message and "DPOTrainer" in message and "CUDA/XPU GPU" in message
    assert "install trl>=1.16" in message
