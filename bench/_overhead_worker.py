"""One overhead run (launched by bench/overhead.py): a LoRA trainer, trl_ext's or TRL's, on a random Llama.

Both sides get the same config object type (trl_ext's configs are TRL's plus the CPU fallbacks), the same model,
data and seed; gradient checkpointing is off, so only the trainer code differs. Prints ``BENCH {json}`` on rank 0:
the median step time over the steps after the first ``--warmup``.
"""

import argparse
import json
import statistics
import tempfile
import time

import torch
import trl
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, TrainerCallback

import trl_ext
from trl_ext.assets import default_model_path

TRAINERS = {"sft": "SFT", "reward": "Reward", "dpo": "DPO"}


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self.start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.start)


def data(kind: str, seq_len: int) -> Dataset:
    text = " ".join(str(i % 97) for i in range(seq_len // 2))
    other = " ".join(str((i * 7) % 97) for i in range(seq_len // 2))
    if kind == "sft":
        return Dataset.from_dict({"text": [text] * 256})
    if kind == "reward":
        return Dataset.from_dict({"chosen": [text] * 256, "rejected": [other] * 256})
    return Dataset.from_dict({"prompt": ["1 2 3"] * 256, "chosen": [text] * 256, "rejected": [other] * 256})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["trl", "trl_ext"], required=True)
    parser.add_argument("--trainer", choices=TRAINERS, required=True)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=256)
    cli = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         max_position_embeddings=2 * cli.seq_len, num_labels=1)
    torch.manual_seed(0)
    model = (LlamaForSequenceClassification if cli.trainer == "reward" else LlamaForCausalLM)(config)
    name = TRAINERS[cli.trainer]
    source = trl_ext if cli.impl == "trl_ext" else trl
    trainer_cls = getattr(source, f"{name}Trainer")
    args = getattr(trl_ext, f"{name}Config")(
        output_dir=tempfile.mkdtemp(prefix="bench-overhead-"), max_steps=cli.steps, per_device_train_batch_size=4,
        max_length=cli.seq_len, learning_rate=1e-4, logging_steps=1000, save_strategy="no", report_to="none",
        seed=0, gradient_checkpointing=False,
    )
    task = "SEQ_CLS" if cli.trainer == "reward" else None  # a config TRL handles correctly: same work on both sides
    timer = StepTimer()
    trainer = trainer_cls(model=model, args=args, train_dataset=data(cli.trainer, cli.seq_len),
                          processing_class=tokenizer, callbacks=[timer],
                          peft_config=LoraConfig(r=8, target_modules="all-linear", task_type=task))
    trainer.train()
    if trainer.accelerator.is_main_process:
        step = statistics.median(timer.times[cli.warmup:])
        print("BENCH " + json.dumps({"step_s": step, "world_size": trainer.accelerator.num_processes}), flush=True)


if __name__ == "__main__":
    main()
