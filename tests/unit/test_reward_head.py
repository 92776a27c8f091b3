"""RewardTrainer: one output, the head found from the model, trained and saved whole under any PEFT config."""

import json
import logging

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig, BertForSequenceClassification

import trl_ext
from trl_ext.assets import load_default_dataset
from trl_ext.trainers.reward_head import head_names

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


def _trainer(tmp_path, model, peft_config=None):
    args = trl_ext.RewardConfig(output_dir=str(tmp_path / "run"), report_to="none", save_strategy="no",
                                max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2)
    return trl_ext.RewardTrainer(model=model, args=args, peft_config=peft_config,
                                 train_dataset=load_default_dataset("reward")["train"].select(range(16)))


def test_head_is_found_from_the_model(tiny_model_path):
    llama = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    assert head_names(llama) == ["score"]
    bert = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=32, num_labels=1))
    assert head_names(bert) == ["classifier"]  # the dropout child has no parameters


def test_all_linear_lora_without_task_type_trains_and_saves_the_head_whole(tmp_path, tiny_model_path, caplog):
    """A LoRA-wrapped head (never trained, never saved), fixed: the user's config is copied, the head goes to
    modules_to_save, one notice says so."""
    user_config = LoraConfig(r=4, target_modules="all-linear")
    with caplog.at_level(logging.WARNING, logger="trl_ext"):
        trainer = _trainer(tmp_path, tiny_model_path, user_config)
    assert "reward head ['score'] is trained and saved whole" in caplog.text
    assert user_config.task_type is None and user_config.modules_to_save is None  # not mutated
    assert trainer.model.config.num_labels == 1
    assert trainer.model.config.pad_token_id == trainer.processing_class.pad_token_id
    assert not [n for n, _ in trainer.model.named_parameters() if "score" in n and "lora_" in n]
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))

    saved = json.loads((tmp_path / "final" / "adapter_config.json").read_text())
    assert saved["task_type"] == "SEQ_CLS" and "score" in saved["modules_to_save"]
    with safe_open(str(tmp_path / "final" / "adapter_model.safetensors"), "pt") as f:
        assert "base_model.model.score.weight" in f.keys()  # noqa: SIM118
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1,
                                                              pad_token_id=trainer.processing_class.pad_token_id)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "final")
    trainer.model.eval()
    assert torch.equal(reloaded(IDS).logits, trainer.model(IDS).logits)


def test_head_listed_in_target_modules_is_moved_to_modules_to_save(tmp_path, tiny_model_path):
    trainer = _trainer(tmp_path, tiny_model_path, LoraConfig(r=4, target_modules=["q_proj", "score"]))
    config = trainer.model.peft_config["default"]
    assert "score" not in config.target_modules and "score" in config.modules_to_save


def test_a_peft_model_whose_head_is_lora_wrapped_is_refused(tmp_path, tiny_model_path):
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    wrapped = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "score"]))
    with pytest.raises(ValueError, match=r"LoRA-wraps the reward head \['score'\].*modules_to_save=\['score'\]"):
        _trainer(tmp_path, wrapped)


def test_a_base_with_a_head_of_another_size_gets_a_new_one_output_head(tmp_path, tiny_model_path, caplog):
    three = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=3)
    three.save_pretrained(tmp_path / "three_labels")
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path / "three_labels")
    with caplog.at_level(logging.WARNING, logger="trl_ext"):
        trainer = _trainer(tmp_path, str(tmp_path / "three_labels"))
    assert "has a 3-output classification head" in caplog.text
    assert trainer.model.config.num_labels == 1 and trainer.model.score.weight.shape[0] == 1


@pytest.mark.slow  # trains for tens of steps
def test_training_improves_held_out_preference_accuracy(tmp_path, tiny_model_path):
    """The report-F2 config (all-linear LoRA, no task_type) now trains a real reward model."""
    data = load_default_dataset("reward")
    args = trl_ext.RewardConfig(output_dir=str(tmp_path / "run"), report_to="none", save_strategy="no",
                                max_steps=150, per_device_train_batch_size=16, per_device_eval_batch_size=32,
                                learning_rate=3e-3, seed=42)
    trainer = trl_ext.RewardTrainer(model=tiny_model_path, args=args, train_dataset=data["train"],
                                    eval_dataset=data["test"], peft_config=LoraConfig(r=8, target_modules="all-linear"))
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    after = trainer.evaluate()["eval_accuracy"]
    print(f"held-out accuracy {before:.3f} -> {after:.3f}")
    assert after >= before + 0.1 and after >= 0.65, (before, after)


def test_a_config_that_already_trains_the_head_is_used_as_given(tiny_model_path, caplog):
    from trl_ext.trainers.reward_head import peft_config_for

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    for config in (LoraConfig(r=4, target_modules="all-linear", task_type="SEQ_CLS"),
                   LoraConfig(r=4, target_modules=["q_proj"], task_type="SEQ_CLS", modules_to_save=["score"])):
        with caplog.at_level(logging.WARNING, logger="trl_ext"):
            assert peft_config_for(model, config) is config
    assert not [r for r in caplog.records if r.name == "trl_ext"]
