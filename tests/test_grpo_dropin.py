"""GRPO and RLOO are drop-ins too: TRL's constructor, TRL's configs, and (one process, fp32, same seed) TRL's logs."""

import inspect

import pytest
import trl
from peft import LoraConfig

import trl_ext
from trl_ext.assets import load_default_dataset
from trl_ext.weight_sync import BoundedVLLMGeneration


@pytest.mark.parametrize("theirs,ours", [(trl.GRPOTrainer, trl_ext.GRPOTrainer),
                                         (trl.RLOOTrainer, trl_ext.RLOOTrainer)])
def test_same_constructor_signature(theirs, ours):
    assert issubclass(ours, theirs)
    assert list(inspect.signature(theirs.__init__).parameters) == list(inspect.signature(ours.__init__).parameters)


def test_configs_fall_back_to_fp32_on_cpu():
    for config_cls in (trl_ext.GRPOConfig, trl_ext.RLOOConfig):
        args = config_cls(output_dir="unused", report_to="none")
        assert isinstance(args, getattr(trl, config_cls.__name__)) and args.bf16 is False


def digit_share(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c[0]["content"]) / max(len(c[0]["content"]), 1) for c in completions]


def _train(trainer_cls, model_path, tmp_path):
    args = trl.GRPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=6, learning_rate=5e-3, logging_steps=1, save_strategy="no",
                          report_to="none", seed=0, bf16=False)
    trainer = trainer_cls(model=model_path, reward_funcs=digit_share, args=args,
                          train_dataset=load_default_dataset("prompt")["train"].select(range(8)),
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    return [v for h in trainer.state.log_history if "reward" in h for v in (h["reward"], h["grad_norm"])]


def test_grpo_same_logs_as_trl(tiny_model_path, tmp_path):
    expected = _train(trl.GRPOTrainer, tiny_model_path, tmp_path / "trl")
    assert _train(trl_ext.GRPOTrainer, tiny_model_path, tmp_path / "trl_ext") == pytest.approx(expected, rel=1e-6)
    assert len(expected) == 4 and expected[1] > 0


def test_vllm_generation_is_ours_while_trl_builds_the_trainer(monkeypatch):
    """TRL constructs VLLMGeneration inline; inside our constructor the name resolves to the bounded sync."""
    import sys

    from trl_ext.trainers import _bounded_weight_sync

    module = sys.modules[trl.GRPOTrainer.__module__]
    original = module.VLLMGeneration
    with _bounded_weight_sync(module):
        assert module.VLLMGeneration is BoundedVLLMGeneration
    assert module.VLLMGeneration is original
