"""Weights that hold NaN or inf are never committed as a checkpoint; the error says when training diverged and which
checkpoint is the last good one."""

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback

import trl_ext
from trl_ext.errors import DIVERGED, CheckpointError

ROWS = [{"text": "1+1=2"}] * 4


class PoisonAt(TrainerCallback):
    """Training that diverges at ``step``: every trainable weight becomes NaN."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                for param in model.parameters():
                    if param.requires_grad:
                        param.fill_(float("nan"))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_divergence_names_the_step_and_the_last_good_checkpoint(lora, tiny_model_path, tmp_path):
    args = trl_ext.SFTConfig(output_dir=str(tmp_path), max_steps=4, save_steps=1, per_device_train_batch_size=2,
                             report_to="none")
    trainer = trl_ext.SFTTrainer(model=tiny_model_path, args=args, train_dataset=Dataset.from_list(ROWS),
                                 peft_config=LoraConfig(r=4, target_modules=["q_proj"]) if lora else None,
                                 callbacks=[PoisonAt(3)])
    with pytest.raises(CheckpointError) as caught:
        trainer.train()
    message = str(caught.value)
    assert caught.value.kind == DIVERGED  # code tests the kind, never the text
    assert message.startswith(f"training diverged at step 3; last good checkpoint: {tmp_path / 'checkpoint-2'} ")
    assert "NaN or inf" in message and "\n" not in message
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]


def test_divergence_before_any_checkpoint(tiny_model_path, tmp_path):
    args = trl_ext.SFTConfig(output_dir=str(tmp_path), max_steps=1, save_strategy="no", report_to="none")
    trainer = trl_ext.SFTTrainer(model=tiny_model_path, args=args, train_dataset=Dataset.from_list(ROWS))
    PoisonAt(0).on_step_end(args, trainer.state, None, model=trainer.model)
    with pytest.raises(CheckpointError, match="^training diverged at step 0; last good checkpoint: none .*start again"):
        trainer.save_model()
