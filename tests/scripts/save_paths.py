"""Train LoRA SFT briefly, then save the ways users do: trainer.save_model, model.save_pretrained, and the raw
state_dict path that writes empty ZeRO-3 placeholders as weights (adapters full of torch.Size([0]) tensors)."""

import sys
from pathlib import Path

from peft import LoraConfig

import trl_ext
from trl_ext.assets import default_model_path, load_default_dataset

out = Path(sys.argv[1])
args = trl_ext.SFTConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=2, report_to="none",
                         save_strategy="no")
trainer = trl_ext.SFTTrainer(model=default_model_path(), args=args,
                             train_dataset=load_default_dataset("sft")["train"].select(range(16)),
                             peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
trainer.train()
trainer.save_model(str(out / "save_model"))
try:
    trainer.model.save_pretrained(str(out / "user_save_pretrained"))  # what many users' scripts and notebooks do
except RuntimeError as exc:
    if trainer.accelerator.is_main_process:
        (out / "user_save_pretrained.error").write_text(str(exc))
# The same call without trl_ext's guard (the class's own method): what PEFT and transformers write by themselves.
type(trainer.model).save_pretrained(trainer.model, str(out / "upstream_save_pretrained"),
                                    is_main_process=trainer.accelerator.is_main_process)
# Handing save_pretrained the local state_dict bypasses the guard: under ZeRO-3 these are the [0] placeholders.
trainer.model.save_pretrained(str(out / "raw_state_dict"), state_dict=trainer.model.state_dict(),
                              is_main_process=trainer.accelerator.is_main_process)
