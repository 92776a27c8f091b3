"""GRPO and RLOO are drop-ins too: TRL's constructor, TRL's configs, and (one process, fp32, same seed) TRL's logs."""

import inspect
from unittest import mock

import pytest
import trl
from peft import LoraConfig

import trl_ext
from trl_ext import saving
from trl_ext.assets import load_default_dataset
from trl_ext.files import commit
from trl_ext.trainers.weight_sync import BoundedVLLMGeneration


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

    from trl_ext.trainers.online import _bounded_weight_sync

    module = sys.modules[trl.GRPOTrainer.__module__]
    original = module.VLLMGeneration
    with _bounded_weight_sync(module, request_timeout=7.0, check_every=3, check_atol=1e-2):
        assert module.VLLMGeneration.func is BoundedVLLMGeneration
        # vllm_request_timeout reaches the client, vllm_check_sync_every/_atol the sync check
        assert module.VLLMGeneration.keywords == {"request_timeout": 7.0, "check_every": 3, "check_atol": 1e-2}
    assert module.VLLMGeneration is original


@pytest.fixture(scope="module")
def rloo_run(tiny_model_path, tmp_path_factory):
    """One short LoRA RLOO run (one process, transformers generation), saved through trl_ext's save path."""
    import torch

    out = tmp_path_factory.mktemp("rloo")
    args = trl_ext.RLOOConfig(output_dir=str(out / "run"), max_steps=3, per_device_train_batch_size=4,
                              num_generations=4, max_completion_length=6, learning_rate=5e-2, logging_steps=1,
                              save_strategy="no", report_to="none", seed=0)
    trainer = trl_ext.RLOOTrainer(model=tiny_model_path, reward_funcs=digit_share, args=args,
                                  train_dataset=load_default_dataset("prompt")["train"].select(range(12)),
                                  peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    with mock.patch.object(saving, "save", wraps=saving.save) as save:
        trainer.save_model(str(out / "final"))
    assert save.call_count == 1, "RLOOTrainer.save_model must go through trl_ext.saving.save"
    ids = torch.tensor([[10 + i for i in range(12)], [40 + 3 * i for i in range(12)]])
    model = trainer.model.eval()
    with torch.no_grad():
        trained = model(input_ids=ids).logits
        with model.disable_adapter():
            untrained = model(input_ids=ids).logits
    return trainer, out / "final", ids, trained, untrained


def test_rloo_trains(rloo_run):
    trainer, _, _, trained, untrained = rloo_run
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in steps] == [1, 2, 3] and all(h["grad_norm"] > 0 for h in steps)
    assert (trained - untrained).abs().max() > 1e-3, "training must have changed the policy"


def test_rloo_saves_through_the_one_save_path_and_reloads_with_plain_peft(rloo_run, tiny_model_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trl_ext.files.audit import audit

    _, saved, ids, trained, _ = rloo_run
    report = audit(str(saved), base=tiny_model_path)  # what trl_ext's save path verified after writing
    assert report.ok, report.format()
    assert not list(saved.parent.glob(f"*{commit.PARTIAL_SUFFIX}")), "staged, then committed: nothing left over"
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), saved).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, trained, atol=1e-5, rtol=1e-5)
