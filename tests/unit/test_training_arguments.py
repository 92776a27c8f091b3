"""A plain ``transformers.TrainingArguments`` as ``args``: converted as TRL converts it (SFT), refused with the fix
where TRL's trainer would fail deep inside (DPO, reward)."""

import pytest
import trl
from datasets import Dataset
from transformers import TrainingArguments

import trl_ext
from trl_ext.engines.runtime import has_accelerator
from trl_ext.trainers.configs import from_training_arguments

SFT_ROWS = [{"text": "1+1=2"}] * 4
PREF_ROWS = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 4


def test_sft_trainer_trains_with_the_converted_config(tiny_model_path, tmp_path):
    # The reproducer: this raised AttributeError: 'TrainingArguments' object has no attribute
    # 'model_init_kwargs' in quantization.adjust_for_engine, before TRL could convert the arguments.
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, learning_rate=3e-4, report_to="none",
                             hub_token="secret")
    trainer = trl_ext.SFTTrainer(model=tiny_model_path, args=args, train_dataset=Dataset.from_list(SFT_ROWS))
    assert isinstance(trainer.args, trl_ext.SFTConfig) and isinstance(trainer.args, trl.SFTConfig)
    assert (trainer.args.output_dir, trainer.args.max_steps, trainer.args.learning_rate) == (str(tmp_path), 2, 3e-4)
    assert trainer.args.hub_token == "secret"  # to_dict() hides it; TRL copies it over, and so do we
    trainer.train()
    assert trainer.state.global_step == 2


def test_conversion_matches_trls_own(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), seed=7, gradient_accumulation_steps=3, report_to="none")
    ours = from_training_arguments(args, trl_ext.SFTConfig, trl.SFTTrainer)
    theirs = trl.SFTConfig(**args.to_dict())  # what trl.SFTTrainer does with it
    assert ours.to_dict() == {**theirs.to_dict(), "max_shard_size": ours.max_shard_size,
                              "save_on_preemption": ours.save_on_preemption,
                              "save_in_background": ours.save_in_background,
                              "memory_checkpoint_steps": ours.memory_checkpoint_steps,
                              "checkpoint_mirror": None, "mirror_storage_options": None,
                              "mirror_grace_period": ours.mirror_grace_period,
                              "mirror_exit_grace_period": ours.mirror_exit_grace_period,
                              # off without an accelerator (nothing to pin for), like bf16 (runtime.adapt_to_hardware)
                              "dataloader_pin_memory": theirs.dataloader_pin_memory and has_accelerator()}


def test_trl_ext_options_set_on_the_training_arguments_come_along(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    args.checkpoint_mirror, args.save_in_background = "s3://bucket/run", True
    ours = from_training_arguments(args, trl_ext.SFTConfig, trl.SFTTrainer)
    assert (ours.checkpoint_mirror, ours.save_in_background) == ("s3://bucket/run", True)


@pytest.mark.parametrize("trainer_cls, config_name", [(trl_ext.DPOTrainer, "DPOConfig"),
                                                      (trl_ext.RewardTrainer, "RewardConfig")])
def test_dpo_and_reward_refuse_it_in_one_line(trainer_cls, config_name, tiny_model_path, tmp_path):
    # TRL's own trainers fail here too: AttributeError: ... no attribute 'model_init_kwargs' (tests/test_formats.py).
    with pytest.raises(TypeError, match=rf"needs a {config_name}, not a TrainingArguments .*{config_name}\(\*\*args"):
        trainer_cls(model=tiny_model_path, args=TrainingArguments(output_dir=str(tmp_path), report_to="none"),
                    train_dataset=Dataset.from_list(PREF_ROWS))
