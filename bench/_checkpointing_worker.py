"""One benchmark run (launched by bench/checkpointing.py): SFT + LoRA on a random Llama, one GC mode.

Prints a JSON line with rank 0's median step time and peak memory growth during training: RSS on CPU,
``torch.cuda.max_memory_allocated`` on a GPU.
"""

import argparse
import json
import os
import resource
import statistics
import tempfile
import time

import psutil
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, TrainerCallback

from trl_ext import SFTConfig, SFTTrainer
from trl_ext.assets import default_model_path

MODES = {
    "none": {"gradient_checkpointing": False},
    "reentrant": {"gradient_checkpointing_kwargs": {"use_reentrant": True}},
    "non-reentrant": {"gradient_checkpointing_kwargs": {"use_reentrant": False}},
}


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self.start, self.rss_at_start = [], None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.rss_at_start = psutil.Process().memory_info().rss
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self.gpu_at_start = torch.cuda.memory_allocated()

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.start)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--gpu_0p5b", action="store_true", help="a ~0.5B Qwen2.5-shaped Llama in bf16, on a GPU")
    cli = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    shape = dict(hidden_size=cli.hidden, intermediate_size=4 * cli.hidden, num_hidden_layers=cli.layers,
                 num_attention_heads=8, num_key_value_heads=8, vocab_size=len(tokenizer))
    if cli.gpu_0p5b:  # Qwen2.5-0.5B's shape (vocab included), random weights: no hub access needed
        shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, vocab_size=151936)
    config = LlamaConfig(max_position_embeddings=cli.seq_len * 2, pad_token_id=tokenizer.pad_token_id, **shape)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16 if cli.gpu_0p5b else torch.float32)
    text = " ".join(str(i % 97) for i in range(cli.seq_len))  # tokenizes to about seq_len tokens
    data = Dataset.from_dict({"text": [text] * 64})
    out = tempfile.mkdtemp(prefix="bench-gc-")
    args = SFTConfig(output_dir=out, max_steps=cli.steps, per_device_train_batch_size=2, max_length=cli.seq_len,
                     learning_rate=1e-4, logging_steps=1000, save_strategy="no", report_to="none", seed=0,
                     **MODES[cli.mode])
    timer = StepTimer()
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                         peft_config=LoraConfig(r=8, target_modules="all-linear"), callbacks=[timer])
    trainer.train()
    if torch.cuda.is_available():
        growth = torch.cuda.max_memory_allocated() - timer.gpu_at_start
    else:
        growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - timer.rss_at_start  # bytes on Linux
    if trainer.accelerator.is_main_process:
        steady = timer.times[2:] or timer.times  # skip warm-up steps
        print("BENCH " + json.dumps({"mode": cli.mode, "step_s": statistics.median(steady),
                                     "peak_growth_mb": max(growth, 0) / 2**20, "pid": os.getpid()}), flush=True)


if __name__ == "__main__":
    main()
