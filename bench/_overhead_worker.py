"""One overhead run (launched by bench/overhead.py): trainers, trl_ext's and/or TRL's, on a random Llama, LoRA or (with
``--full``) a full fine-tuning.

Both sides get the same config class (trl_ext's configs are TRL's plus the CPU fallbacks), the same model, data and
seed. Gradient checkpointing is off unless ``--gc``: then both sides checkpoint as they set it up (trl_ext's
``use_reentrant=False``; TRL's, transformers' default, the same in 5.24). A step is a whole loop
iteration, from one ``on_step_begin`` to the next: forward, backward, optimizer, every callback, logging and the
next batch.

``--impl both`` (one process): a TRL trainer and a trl_ext trainer in the same process, each ``train()`` in its own
thread, taking turns step by step (a baton passed at ``on_step_begin``; ``--first`` says who starts), so that both
see the same machine load, step after step, on a shared machine. ``--impl trl`` / ``trl_ext``: one trainer (used
under ZeRO-3, where two DeepSpeed engines in one process are not a supported setup).
``--count_calls``: also every Python function called during steps 5 and 6 (rank 0), to compare the work per step.
Prints ``BENCH {json}`` on rank 0: each side's step times after the first ``--warmup``.
"""

import argparse
import collections
import copy
import json
import sys
import tempfile
import time

import torch
import trl
from _pairing import Baton, train_in_turns  # bench/, on the path when this file runs
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, TrainerCallback

import trl_ext
from trl_ext.assets import default_model_path

TRAINERS = {"sft": "SFT", "reward": "Reward", "dpo": "DPO"}


class StepTimer(TrainerCallback):
    """Time from one step's start to the next one's; with a baton, the other trainer runs in between, untimed."""

    def __init__(self, name: str, baton: Baton | None = None):
        self.name, self.baton, self.times, self.start = name, baton, [], None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.start is not None:
            self.times.append(time.perf_counter() - self.start)
        if self.baton is not None:
            self.baton.pass_and_wait(self.name)
        self.start = time.perf_counter()


class CallCounter(TrainerCallback):
    """Every Python function called during steps 5 and 6, by file and name (``sys.setprofile``, this thread)."""

    def __init__(self):
        self.step, self.calls = 0, collections.Counter()

    def _hook(self, frame, event, arg):
        if event == "call":
            code = frame.f_code
            self.calls[f"{code.co_filename.split('site-packages/')[-1]}:{code.co_qualname}"] += 1

    def on_step_begin(self, args, state, control, **kwargs):
        self.step += 1
        sys.setprofile(self._hook if self.step in (5, 6) else None)

    def on_train_end(self, args, state, control, **kwargs):
        sys.setprofile(None)


def data(kind: str, seq_len: int) -> Dataset:
    text = " ".join(str(i % 97) for i in range(seq_len // 2))
    other = " ".join(str((i * 7) % 97) for i in range(seq_len // 2))
    if kind == "sft":
        return Dataset.from_dict({"text": [text] * 256})
    if kind == "reward":
        return Dataset.from_dict({"chosen": [text] * 256, "rejected": [other] * 256})
    return Dataset.from_dict({"prompt": ["1 2 3"] * 256, "chosen": [text] * 256, "rejected": [other] * 256})


def build(impl: str, cli, *callbacks: TrainerCallback):
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = LlamaConfig(hidden_size=cli.hidden, intermediate_size=4 * cli.hidden, num_hidden_layers=cli.layers,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=len(tokenizer),
                         pad_token_id=tokenizer.pad_token_id, max_position_embeddings=2 * cli.seq_len, num_labels=1)
    torch.manual_seed(0)
    model = (LlamaForSequenceClassification if cli.trainer == "reward" else LlamaForCausalLM)(config)
    name = TRAINERS[cli.trainer]
    ours = impl == "trl_ext" and not getattr(cli, "control", False)  # --control: TRL on both sides
    trainer_cls = getattr(trl_ext if ours else trl, f"{name}Trainer")
    args = getattr(trl_ext, f"{name}Config")(
        output_dir=tempfile.mkdtemp(prefix="bench-overhead-"), max_steps=cli.steps,
        per_device_train_batch_size=cli.batch, max_length=cli.seq_len, learning_rate=1e-4, logging_steps=1000,
        save_strategy="no", report_to="none", seed=0, gradient_checkpointing=cli.gc,
    )
    task = "SEQ_CLS" if cli.trainer == "reward" else None  # a config TRL handles correctly: same work on both sides
    peft_config = None if cli.full else LoraConfig(r=8, target_modules="all-linear", task_type=task)
    # full DPO: a reference model given, the same weights (TRL would load one from the policy's path; it has none)
    reference = {"ref_model": copy.deepcopy(model)} if cli.full and cli.trainer == "dpo" else {}
    return trainer_cls(model=model, args=args, train_dataset=data(cli.trainer, cli.seq_len),
                       processing_class=tokenizer, callbacks=list(callbacks), peft_config=peft_config, **reference)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["trl", "trl_ext", "both"], required=True)
    parser.add_argument("--trainer", choices=TRAINERS, required=True)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--count_calls", action="store_true", help="one impl: count the calls of steps 5 and 6")
    parser.add_argument("--first", choices=["trl", "trl_ext"], default="trl", help="with --impl both: who starts")
    parser.add_argument("--control", action="store_true", help="the 'trl_ext' side runs TRL's trainer too (A/A)")
    parser.add_argument("--gc", action="store_true", help="gradient checkpointing on, on both sides")
    parser.add_argument("--full", action="store_true", help="a full fine-tuning instead of LoRA")
    cli = parser.parse_args()

    impls = ["trl", "trl_ext"] if cli.impl == "both" else [cli.impl]
    if cli.first == "trl_ext":
        impls.reverse()
    baton = Baton(impls) if len(impls) > 1 else None
    timers = {impl: StepTimer(impl, baton) for impl in impls}
    counter = CallCounter() if cli.count_calls else None
    trainers = {impl: build(impl, cli, timers[impl], *([counter] if counter else [])) for impl in impls}
    if baton is None:
        trainers[impls[0]].train()
    else:
        train_in_turns(trainers, baton)
    accelerator = trainers[impls[0]].accelerator
    if accelerator.is_main_process:
        times = {impl: timers[impl].times[cli.warmup:] for impl in impls}
        result = {"times": times, "world_size": accelerator.num_processes}
        if counter is not None:
            result["calls"] = dict(counter.calls)
        print("BENCH " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
