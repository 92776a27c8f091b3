"""Train the embedded tiny VLM on the shapes data (SFT or DPO, LoRA on the language model or its full fine-tune, the
vision tower frozen) and record what happened; run under ``accelerate launch`` (see ``tests/harness.py``).

Writes ``report_rank0.json`` (per-layer checkpointing setting, partitioning, trainable parameters, losses) and
``probe_logits.pt``: the trained model's logits on image+text probes, computed in the training processes.
"""

import argparse
import json
import os
import signal

import launched  # tests/scripts/, beside this file
import torch
from peft import LoraConfig
from transformers import AutoProcessor, TrainerCallback

import trl_ext
from trl_ext.assets import load_shapes, vlm_model_path
from trl_ext.data.vision import freeze_vision_tower, vision_tower
from trl_ext.engines.gradient_checkpointing import layer_settings

LM_LINEARS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def probe_batch(processor, n: int = 4) -> dict:
    """The first ``n`` test conversations with their images, right-padded (the same on every rank)."""
    rows = load_shapes("sft")["test"][:n]
    texts = [processor.apply_chat_template(m) for m in rows["messages"]]
    return processor(images=rows["images"], text=texts, return_tensors="pt", padding=True)


class Record(TrainerCallback):
    def __init__(self, kill_at: int | None):
        self.seen, self.kill_at = None, kill_at

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.seen is None:
            params = list(model.parameters())
            self.seen = {
                "layers": layer_settings(model),
                "num_partitioned": sum(1 for p in params if hasattr(p, "ds_shape") and p.shape == (0,)),
                "vision_trainable": sum(p.requires_grad for p in vision_tower(model).parameters()),
                "lm_trainable": sum(p.requires_grad for n, p in model.named_parameters() if "language_model" in n),
            }
        if self.kill_at is not None and state.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # every rank: no clean shutdown, as a node failure


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=["sft", "dpo"], default="sft")
    parser.add_argument("--mode", choices=["lora", "full"], default="lora")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=3)
    parser.add_argument("--save_steps", type=int, default=0)
    parser.add_argument("--kill_at", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--reentrant", action="store_true", help="use_reentrant=True (TRL's PEFT + ZeRO-3 choice)")
    a = parser.parse_args(argv)

    trainer_class, config_class = {"sft": (trl_ext.SFTTrainer, trl_ext.SFTConfig),
                                   "dpo": (trl_ext.DPOTrainer, trl_ext.DPOConfig)}[a.trainer]
    extra = {"assistant_only_loss": True} if a.trainer == "sft" else {"beta": 0.5}
    args = config_class(
        output_dir=a.output_dir, max_steps=a.max_steps, per_device_train_batch_size=4, learning_rate=1e-2,
        logging_steps=1, report_to="none", seed=0, max_length=None, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": a.reentrant} if a.reentrant else None,
        save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500, **extra)
    peft = (LoraConfig(r=8, lora_alpha=16, target_modules=LM_LINEARS, modules_to_save=["lm_head"])
            if a.mode == "lora" else None)
    data = load_shapes("sft" if a.trainer == "sft" else "preference")["train"].select(range(32))
    trainer = trainer_class(model=vlm_model_path(), args=args, train_dataset=data, peft_config=peft)
    freeze_vision_tower(trainer.model)
    record = Record(a.kill_at)
    trainer.add_callback(record)
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    trainer.save_model(a.output_dir)

    # The trained outputs on image+text probes, in the training processes (every rank runs the forward: ZeRO-3)
    batch = probe_batch(AutoProcessor.from_pretrained(vlm_model_path()))
    model = trainer.model  # ZeRO-3's hooks on its modules gather each layer's parameters
    model.eval()
    with torch.no_grad():
        logits = model(**{k: v.to(trainer.args.device) for k, v in batch.items()}).logits.float().cpu()
    if trainer.is_world_process_zero():
        torch.save(logits, os.path.join(a.output_dir, "probe_logits.pt"))
        losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
        report = {**(record.seen or {}), "losses": losses, "world_size": trainer.args.world_size}
        with open(os.path.join(a.output_dir, "report_rank0.json"), "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    launched.freeze_imports()  # see launched.py
    main()
    launched.finish()  # see launched.py
