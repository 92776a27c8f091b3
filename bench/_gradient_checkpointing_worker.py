"""One benchmark run (launched by bench/gradient_checkpointing.py): SFT + LoRA on a random Llama, one GC mode.

Prints a JSON line with rank 0's median step time, peak memory growth during training (RSS on CPU,
``torch.cuda.max_memory_allocated`` on a GPU) and parameter elements all-gathered per step (ZeRO-3 or FSDP2,
tests/probes/gather_count.py). With ``--probe`` (CPU) it also reports rank 0's peak RSS per phase of a
step (forward, backward, optimizer step) and, under ZeRO-3, what is gathered while each decoder layer is recomputed
in the backward: how many parameters are AVAILABLE in total and in the layers after it (already backpropagated).
"""

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.harness, tests.probes

import psutil
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, TrainerCallback
from transformers.modeling_layers import GradientCheckpointingLayer

from tests.probes.gather_count import GatherCount
from tests.probes.tensor_peak import step_peaks
from trl_ext import SFTConfig, SFTTrainer
from trl_ext.assets import default_model_path
from trl_ext.process import end_together

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
        if torch.cuda.is_available():  # a GPU runs ahead of Python: time its work, not the launches
            torch.cuda.synchronize()
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.start)


class Probe(TrainerCallback):
    """Rank 0's peak RSS per phase (sampled every 5 ms and at every hook) and ZeRO-3 gathering during recompute."""

    def __init__(self, gathers: GatherCount):
        self.phase, self.base, self.peak = "idle", None, {}
        # per recompute of a layer: (layer, gathered numel after it, gathered numel in total)
        self.recompute, self.gathers = [], gathers
        self.layers, self.steps, self.stop, self.recomputing = [], 0, threading.Event(), None

    def sample(self):
        if self.steps < 2:  # skip warm-up steps (first allocations, DeepSpeed's trace)
            return
        rss = psutil.Process().memory_info().rss
        self.peak[self.phase] = max(self.peak.get(self.phase, 0), rss)

    def run(self):
        while not self.stop.wait(0.005):
            self.sample()

    def set_phase(self, phase):
        self.sample()
        self.phase, self.recomputing = phase, None
        self.gathers.phase = phase

    def gathered(self, module):
        return sum(p.ds_numel for p in module.parameters() if getattr(p, "ds_status", None) is not None
                   and p.ds_status.name == "AVAILABLE")

    def on_layer(self, index):
        def hook(module, args):
            if torch._C._current_graph_task_id() == -1 or index == self.recomputing:
                return  # a plain forward, or a later submodule of the layer being recomputed
            self.recomputing = index
            self.sample()
            if self.steps >= 2 and hasattr(next(module.parameters()), "ds_status"):
                later = sum(self.gathered(layer) for layer in self.layers[index + 1:])
                self.recompute.append((index, later, self.gathered(self.model)))
        return hook

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.model = model
        self.layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        for i, layer in enumerate(self.layers):  # the recompute runs the layer's forward, not its hooks: hook inside
            for sub in layer.modules():
                if sub is not layer and list(sub.parameters(recurse=False)):
                    sub.register_forward_pre_hook(self.on_layer(i))
        model.register_forward_pre_hook(lambda m, a: self.set_phase("forward") if torch.is_grad_enabled()
                                        and torch._C._current_graph_task_id() == -1 else None)
        model.register_forward_hook(lambda m, a, o: self.set_phase("backward") if torch.is_grad_enabled()
                                    and torch._C._current_graph_task_id() == -1 else None)
        try:  # under DeepSpeed, accelerate runs the optimizer step inside its backward call
            from deepspeed.runtime.engine import DeepSpeedEngine

            step = DeepSpeedEngine.step

            def timed_step(engine, *a, **k):
                self.set_phase("optimizer")
                return step(engine, *a, **k)

            DeepSpeedEngine.step = timed_step
        except ImportError:
            pass
        self.base = psutil.Process().memory_info().rss
        threading.Thread(target=self.run, daemon=True).start()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.set_phase("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        self.set_phase("idle")
        self.steps += 1
        if self.steps == 2:  # warm-up steps (first allocations, DeepSpeed's trace) are not counted
            self.gathers.per_phase = {}

    def report(self):
        self.stop.set()
        total = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in self.model.parameters())
        per_layer = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in self.layers[0].parameters())
        out = {"peak_mb": {k: (v - self.base) / 2**20 for k, v in self.peak.items()},
               "params": total, "layer_params": per_layer,
               "gathered_per_step": {k: v / max(self.steps - 2, 1) for k, v in self.gathers.per_phase.items()}}
        if self.recompute:
            out["recompute_later_max"] = max(r[1] for r in self.recompute)
            out["recompute_gathered_max"] = max(r[2] for r in self.recompute)
            out["recompute_first_step"] = self.recompute[:len(self.layers)]
        return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    parser.add_argument("--probe", action="store_true", help="phase peaks and ZeRO-3 gathering during recompute")
    parser.add_argument("--gpu_0p5b", action="store_true", help="a ~0.5B Qwen2.5-shaped Llama in bf16, on a GPU")
    parser.add_argument("--tensor_peak", action="store_true",
                        help="also the peak bytes of live tensors (tests/probes/tensor_peak.py), a count")
    cli = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    shape = dict(hidden_size=cli.hidden, intermediate_size=4 * cli.hidden, num_hidden_layers=cli.layers,
                 num_attention_heads=8, num_key_value_heads=8, vocab_size=len(tokenizer))
    if cli.gpu_0p5b:  # Qwen2.5-0.5B's shape (vocab and tied embeddings included: 494M), random weights
        shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
    config = LlamaConfig(max_position_embeddings=cli.seq_len * 2, pad_token_id=tokenizer.pad_token_id, **shape)
    torch.manual_seed(0)
    with torch.device("cuda" if cli.gpu_0p5b and torch.cuda.is_available() else "cpu"):  # a 0.5B init: seconds on CPU
        model = LlamaForCausalLM(config).to(torch.bfloat16 if cli.gpu_0p5b else torch.float32)
    text = " ".join(str(i % 97) for i in range(cli.seq_len))  # tokenizes to about seq_len tokens
    data = Dataset.from_dict({"text": [text] * 64})
    out = tempfile.mkdtemp(prefix="bench-gc-")
    args = SFTConfig(output_dir=out, max_steps=cli.steps, per_device_train_batch_size=2, max_length=cli.seq_len,
                     learning_rate=1e-4, logging_steps=1000, save_strategy="no", report_to="none", seed=0,
                     **MODES[cli.mode])
    timer, gathers = StepTimer(), GatherCount()
    probe = Probe(gathers)
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                         peft_config=None if cli.full else LoraConfig(r=8, target_modules="all-linear"),
                         callbacks=[timer, gathers] + ([probe] if cli.probe else []))
    with step_peaks(trainer) if cli.tensor_peak else contextlib.nullcontext([]) as peaks:
        trainer.train()
    if torch.cuda.is_available():
        growth = torch.cuda.max_memory_allocated() - timer.gpu_at_start
    else:
        growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - timer.rss_at_start  # bytes on Linux
    if trainer.accelerator.is_main_process:
        steady = timer.times[2:] or timer.times  # skip warm-up steps
        result = {"mode": cli.mode, "step_s": statistics.median(steady), "peak_growth_mb": max(growth, 0) / 2**20,
                  "gathered_per_step": statistics.median(gathers.per_step[2:] or gathers.per_step),
                  "model_numel": sum(getattr(p, "ds_numel", None) or p.numel() for p in model.parameters()),
                  "pid": os.getpid()}
        if cli.probe:
            result["probe"] = probe.report()
        if cli.tensor_peak:  # each step's peak of live tensor bytes over its start, median
            result["tensor_peak_mb"] = statistics.median(peaks[2:] or peaks) / 2**20
        print("BENCH " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
    # the ranks end as trl_ext's recipes do: a process that leaves a gloo group can abort at exit after its work is done
    # (pytorch#190489), which would fail a finished run
    end_together()
