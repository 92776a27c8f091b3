"""Train one of the three trainers on the embedded model and data; write what happened to a JSON file.

Run alone (single process) or under ``accelerate launch`` (see ``tests/harness.py``). Records per-step losses and,
under DeepSpeed, proof that ZeRO-3 really partitioned the parameters.
"""

import argparse
import json
import os

import torch
from peft import LoraConfig
from safetensors.torch import save_file
from transformers import TrainerCallback

import trl_ext
from trl_ext.assets import default_model_path, load_default_dataset
from trl_ext.checkpointing import layer_settings

TRAINERS = {
    "sft": (trl_ext.SFTTrainer, trl_ext.SFTConfig, "sft"),
    "reward": (trl_ext.RewardTrainer, trl_ext.RewardConfig, "reward"),
    "dpo": (trl_ext.DPOTrainer, trl_ext.DPOConfig, "preference"),
}


def partition_report(model) -> dict:
    params = list(model.parameters())
    partitioned = [p for p in params if hasattr(p, "ds_shape") and p.shape == (0,) and p.ds_numel > 0]
    return {
        "num_params": len(params),
        "num_partitioned": len(partitioned),
        "example": [list(partitioned[0].shape), list(partitioned[0].ds_shape)] if partitioned else None,
    }


GC_MODES = {
    "default": {},  # TRL's config default: checkpointing on, use_reentrant unset
    "off": {"gradient_checkpointing": False},
    "reentrant": {"gradient_checkpointing_kwargs": {"use_reentrant": True}},
    "nonreentrant": {"gradient_checkpointing_kwargs": {"use_reentrant": False}},
}


class RecordCheckpointing(TrainerCallback):
    """What the layers' checkpoint functions actually use, seen mid-training, and whether input hooks exist."""

    def __init__(self):
        self.seen = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.seen is None:
            hooks = [m for m in model.modules() if getattr(m, "_require_grads_hooks", None)]
            self.seen = {"layers": layer_settings(model), "input_hooks": len(hooks)}


def gathered_trainable(model) -> dict:
    """Full (gathered) trainable weights, on every rank."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    try:
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None)
    except ImportError:
        ctx = torch.no_grad()
    with ctx:
        return {n: p.detach().cpu().clone().contiguous() for n, p in params.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=TRAINERS, required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=3)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--gc", choices=GC_MODES, default="default")
    parser.add_argument("--grad_accum", type=int, default=1)
    cli = parser.parse_args()

    trainer_cls, config_cls, data_kind = TRAINERS[cli.trainer]
    dataset = load_default_dataset(data_kind)["train"].select(range(cli.rows))
    args = config_cls(
        output_dir=cli.output_dir,
        max_steps=cli.max_steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=cli.grad_accum,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        dataloader_num_workers=0,
        **GC_MODES[cli.gc],
    )
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if cli.lora else None
    recorder = RecordCheckpointing()
    trainer = trainer_cls(model=default_model_path(), args=args, train_dataset=dataset, peft_config=peft_config,
                          callbacks=[recorder])
    report = {"world_size": args.world_size, "zero_stage": None, "partition": None}
    if args.deepspeed_plugin is not None:
        report["zero_stage"] = args.deepspeed_plugin.zero_stage
    result = trainer.train()
    if trainer.is_deepspeed_enabled:
        report["partition"] = partition_report(trainer.model_wrapped)
    report["losses"] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    report["train_loss"] = result.training_loss
    report["global_step"] = trainer.state.global_step
    report["checkpointing"] = recorder.seen
    weights = gathered_trainable(trainer.model)
    if trainer.accelerator.is_main_process:
        save_file(weights, os.path.join(cli.output_dir, "trained.safetensors"))
    if trainer.accelerator.is_main_process:
        with open(os.path.join(cli.output_dir, f"report_rank{trainer.accelerator.process_index}.json"), "w") as f:
            json.dump(report, f)
    torch.distributed.barrier() if torch.distributed.is_initialized() else None


if __name__ == "__main__":
    main()
