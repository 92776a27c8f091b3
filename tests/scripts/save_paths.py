"""Train LoRA SFT briefly, then save the two ways users do: trainer.save_model and model.save_pretrained."""

import sys

from peft import LoraConfig

import trl_ext
from trl_ext.assets import default_model_path, load_default_dataset

out = sys.argv[1]
args = trl_ext.SFTConfig(output_dir=out, max_steps=2, per_device_train_batch_size=2, report_to="none",
                         save_strategy="no")
trainer = trl_ext.SFTTrainer(model=default_model_path(), args=args,
                             train_dataset=load_default_dataset("sft")["train"].select(range(16)),
                             peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
trainer.train()
trainer.save_model(f"{out}/save_model")
trainer.model.save_pretrained(f"{out}/user_save_pretrained")  # what many users' scripts and notebooks do
