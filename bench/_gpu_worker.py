"""One GPU benchmark run (launched by bench/gpu.py): SFT or DPO, LoRA or full fine-tuning, with or without gradient
checkpointing, trl_ext's trainer or TRL's, on a ~0.5B Qwen2.5-shaped Llama built from config (random weights, bf16).

Prints ``BENCH {json}`` with tokens/s, peak GPU memory and model FLOPs over the steps after ``--warmup``, and the
run's whole time and build time (``run_s``, ``build_s``: what a repeat costs). ``--control``: an A/A control's run,
TRL's trainer on the trl_ext side too (bench/_pairing.py).
``--smoke`` runs the same code on a tiny fp32 model on CPU (peak memory is then "n/a") and checks the FLOPs formula
against ``torch.utils.flop_counter`` on one step.

FLOPs convention (model FLOPs, not hardware FLOPs: the recompute of gradient checkpointing is not counted):
- a weight matrix with N elements costs 2N per token forward and 4N backward (input and weight gradients) when it is
  trained; a frozen one (LoRA's base weights) costs 2N + 2N (no weight gradient). N counts every nn.Linear, lm_head
  included; the embedding lookup costs nothing.
- attention scores and values: 4·T·d_attn per token and layer forward, twice that backward (PaLM's 12·L·T·d_attn
  for a training token; T is the padded sequence length, the causal mask is not halved).
- DPO: tokens are those of chosen + rejected; the reference model's forward pass (2N + 4·L·T·d_attn per token, on the
  same tokens) is counted, since the step computes it.
Tokens are the non-padding tokens the step trains on. Checked against ``torch.utils.flop_counter`` (``--flop_check``):
exact for full fine-tuning; for LoRA the formula is slightly high, since the first layer's q/k/v projections need no
input gradient (2% on the 2-layer smoke model, about 0.1% on 24 layers).
"""

import argparse
import contextlib
import copy
import gc
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import torch
import trl
from _device_figures import collect as collect_figures
from _device_profile import ProfileSteps
from _pairing import Baton, train_in_turns
from accelerate.state import AcceleratorState, GradientState
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, TrainerCallback

import trl_ext
from trl_ext.assets import default_model_path

# Qwen2.5-0.5B's shape, vocabulary and tied embeddings included: 494M parameters.
SHAPE_0P5B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
SHAPE_SMOKE = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)


class StepMeter(TrainerCallback):
    """Step wall times (the GPU synchronised at both ends) and, through ``count``, the tokens each step trains on."""

    def __init__(self):
        self.times, self.tokens, self.lengths, self.start = [], [], [], None
        self._tokens = self._length = 0

    def count(self, inputs) -> None:
        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        self._tokens += int(mask.sum()) if mask is not None else ids.numel()
        self._length = max(self._length, ids.shape[-1])

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._tokens = self._length = 0
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.start)
        self.tokens.append(self._tokens)
        self.lengths.append(self._length)


class Figures(TrainerCallback):
    """What the run trains, read from its trainer after the first optimizer step (bench/_device_figures.py): the
    self-checks and the memory floor of bench/device_check.py's throughput step."""

    def __init__(self):
        self.trainer, self.found = None, None

    def on_step_end(self, args, state, control, **kwargs):
        if self.found is None and self.trainer is not None:  # the optimizer's states exist from the first step on
            t = self.trainer
            self.found = collect_figures(t.model, t.optimizer, getattr(t, "ref_model", None))


def linear_sizes(model) -> tuple[int, int]:
    """(elements of frozen nn.Linear weights, elements of trained ones), each weight counted once."""
    frozen = trained = 0
    seen = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            if module.weight.requires_grad:
                trained += module.weight.numel()
            else:
                frozen += module.weight.numel()
    return frozen, trained


def step_flops(tokens: int, length: int, frozen: int, trained: int, layers: int, d_attn: int, dpo: bool) -> dict:
    """Model FLOPs of one training step, split into matmuls with weights and attention (see the module docstring)."""
    weights = tokens * (4 * frozen + 6 * trained)
    attention = tokens * 12 * layers * length * d_attn
    if dpo:  # the reference forward on the same tokens: the base weights (LoRA: the adapter disabled; full: a copy)
        weights += tokens * 2 * (frozen or trained)
        attention += tokens * 4 * layers * length * d_attn
    return {"weights": weights, "attention": attention, "total": weights + attention}


def flop_counter_check(trainer, meter, frozen, trained, config, d_attn) -> dict:
    """The formula against ``torch.utils.flop_counter`` on the trainer's first batch: the policy's forward and backward
    (and DPO's reference forward), called directly. TRL's own step is not counted: its fused lm_head kernel
    accumulates with in-place ``addmm_``, which the counter does not see."""
    from torch.utils.flop_counter import FlopCounterMode

    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    meter.count(batch)
    tokens, length, meter._tokens, meter._length = meter._tokens, meter._length, 0, 0
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")}
    model, dpo, ref_model = trainer.model, isinstance(trainer, trl.DPOTrainer), getattr(trainer, "ref_model", None)
    # Eager attention for the count: the counter does not see the CPU SDPA kernel. Training keeps its own.
    models = [m.get_base_model() if hasattr(m, "get_base_model") else m for m in (model, ref_model) if m]
    previous = [m.config._attn_implementation for m in models]
    for m in models:
        m.set_attn_implementation("eager")
    counter = FlopCounterMode(display=False)
    with counter:
        model(**inputs, labels=batch["input_ids"]).loss.backward()
        if dpo:
            with torch.no_grad(), (model.disable_adapter() if ref_model is None else contextlib.nullcontext()):
                (ref_model or model)(**inputs)
    model.zero_grad(set_to_none=True)
    for m, attn in zip(models, previous):
        m.set_attn_implementation(attn)
    expected = step_flops(tokens, length, frozen, trained, config.num_hidden_layers, d_attn, dpo)
    return {"counted": counter.get_total_flops(), **expected, "counted/formula": counter.get_total_flops() /
            expected["total"]}


def data(kind: str, seq_len: int, rows: int = 512) -> Dataset:
    rng = random.Random(0)

    def text(n):  # about 1.7 tokens per number with the embedded tokenizer; max_length truncates the rest
        return " ".join(str(rng.randrange(1000)) for _ in range(n))

    if kind == "sft":
        return Dataset.from_dict({"text": [text(seq_len) for _ in range(rows)]})
    prompt_len = max(4, seq_len // 16)
    return Dataset.from_dict({"prompt": [text(prompt_len // 2) for _ in range(rows)],
                              "chosen": [text(seq_len) for _ in range(rows)],
                              "rejected": [text(seq_len) for _ in range(rows)]})


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["trl", "trl_ext"])
    parser.add_argument("--trainer", choices=["sft", "dpo"])
    parser.add_argument("--tuning", choices=["lora", "full"])
    parser.add_argument("--gc", choices=["on", "off"])
    parser.add_argument("--plan", help="several workloads in this process, one after another: a JSON list of "
                        "{impl, trainer, tuning, gc[, control, repeat]}; prints one BENCH line each")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (DPO: pairs = batch / 2)")
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 model on CPU, same code path")
    parser.add_argument("--flop_check", action="store_true", help="check the FLOPs formula with torch's counter")
    parser.add_argument("--reentrant", action="store_true",
                        help="gradient_checkpointing_kwargs={'use_reentrant': True} (bench/_device_steps.diagnose)")
    parser.add_argument("--paired", action="store_true",
                        help="TRL's trainer and this side in one process, taking turns step by step (run_paired)")
    parser.add_argument("--keep_input_grads_hook", action="store_true",
                        help="trl_ext's trainer with TRL's input-require-grads hook kept (the one autograd difference "
                             "trl_ext makes under PEFT + checkpointing; bench/_device_diagnose.py)")
    parser.add_argument("--profile_steps", type=int, default=0,
                        help="profile the last N steps with torch's profiler (bench/_device_profile.py)")
    parser.add_argument("--results", help="also append each result to this file, one JSON line each")
    parser.add_argument("--control", action="store_true",
                        help="A/A control: the trl_ext side runs TRL's trainer too (bench/_pairing.py)")
    parser.add_argument("--repeat", type=int, default=0, help="which repeat of its pairing this run is (reported)")
    cli = parser.parse_args(argv)
    if not cli.plan and None in (cli.impl, cli.trainer, cli.tuning, cli.gc):
        parser.error("give --impl, --trainer, --tuning and --gc, or --plan")
    return cli


@contextlib.contextmanager
def kept_input_grads_hook(keep: bool):
    """With ``keep``: trl_ext leaves TRL's input-require-grads hook in place (its removal, a no-op inside the block),
    so that the diagnose step can time trl_ext without the one change it makes to the autograd graph."""
    if not keep:
        yield
        return
    from trl_ext.engines import gradient_checkpointing

    removal = gradient_checkpointing.remove_input_require_grads_hooks
    gradient_checkpointing.remove_input_require_grads_hooks = lambda model: None
    try:
        yield
    finally:
        gradient_checkpointing.remove_input_require_grads_hooks = removal


def build(cli: argparse.Namespace, on_gpu: bool, callbacks: list, ours: bool, reentrant: bool,
          keep_hook: bool) -> dict:
    """One side's model, config and trainer for the workload in ``cli`` (``ours``: trl_ext's trainer, else TRL's;
    ``reentrant``, ``keep_hook``: the diagnose step's variants). Returns ``{"trainer", "config", "params", "meter",
    "output_dir"}``; the trainer's ``training_step`` counts each batch's tokens into ``meter``."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    shape = SHAPE_SMOKE if cli.smoke else SHAPE_0P5B
    config = LlamaConfig(max_position_embeddings=2 * cli.seq_len, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **shape)
    config._attn_implementation = cli.attn
    torch.manual_seed(0)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    with torch.device("cuda" if on_gpu else "cpu"):
        model = LlamaForCausalLM(config).to(dtype)
    params = sum(p.numel() for p in model.parameters())

    name = {"sft": "SFT", "dpo": "DPO"}[cli.trainer]
    trainer_cls = getattr(trl_ext if ours else trl, f"{name}Trainer")
    per_device = cli.batch if cli.trainer == "sft" else max(1, cli.batch // 2)  # DPO: each row is a pair
    args = getattr(trl_ext, f"{name}Config")(
        output_dir=tempfile.mkdtemp(prefix="bench-gpu-"), max_steps=cli.steps, per_device_train_batch_size=per_device,
        max_length=cli.seq_len, learning_rate=1e-5, logging_steps=10_000, save_strategy="no", report_to="none",
        seed=0, gradient_checkpointing=cli.gc == "on", bf16=on_gpu, dataloader_num_workers=0,
        # trl_ext honours an explicit choice (its default is non-reentrant); TRL passes it on to transformers
        gradient_checkpointing_kwargs={"use_reentrant": True} if reentrant else None,
    )
    peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear") if cli.tuning == "lora" else None
    extra = {}
    if cli.trainer == "dpo" and peft_config is None:  # TRL would reload the reference from the hub name: pass a copy
        extra["ref_model"] = copy.deepcopy(model).eval().requires_grad_(False)
    meter = next(c for c in callbacks if isinstance(c, StepMeter))
    dataset = data(cli.trainer, cli.seq_len, rows=cli.steps * per_device)  # one epoch: no row is tokenized for nothing
    with kept_input_grads_hook(keep_hook):
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=callbacks, peft_config=peft_config, **extra)
    training_step = trainer.training_step  # the same wrapper on both sides: it only reads the batch

    def counted_step(model, inputs, *rest, **kwargs):
        meter.count(inputs)
        return training_step(model, inputs, *rest, **kwargs)

    trainer.training_step = counted_step
    return {"trainer": trainer, "config": config, "params": params, "meter": meter, "output_dir": args.output_dir}


def tear_down(*output_dirs: str) -> None:
    """After a run: its folders removed, accelerate's shared state cleared (a next run in this process builds its
    own accelerator), its memory given back."""
    for output_dir in output_dirs:
        shutil.rmtree(output_dir, ignore_errors=True)
    for cls in (AcceleratorState, GradientState):
        cls._shared_state.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(cli: argparse.Namespace) -> dict:
    """One workload (``cli.impl``, ``cli.trainer``, ``cli.tuning``, ``cli.gc``); returns what ``main`` prints."""
    if cli.paired:
        return run_paired(cli)
    began = time.perf_counter()  # the run's whole time, its build and teardown included: what a repeat costs
    on_gpu = torch.cuda.is_available() and not cli.smoke
    # The peak is torch.cuda.max_memory_allocated() itself, from a peak reset here, after what an earlier run of this
    # process left was freed. Subtracting what the process held at the start (as the 2026-11-28 --one_process run did)
    # is only right while that memory stays held: leftovers freed during the run make room for the run's own tensors
    # and the difference undercounts (the likely cause of that run's peaks below the weights, gradients and optimizer
    # states alone: bench/RESULTS.md). Whatever is still held now can only raise the peak: held_before_bytes says it.
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    held_before = torch.cuda.memory_allocated() if on_gpu else 0
    meter = StepMeter()
    figures = Figures()
    callbacks = [meter, figures]
    profile = None
    if cli.profile_steps:  # the last steps: the first ones build caches
        profile = ProfileSteps(max(1, cli.steps - cli.profile_steps + 1), min(cli.profile_steps, cli.steps), on_gpu)
        callbacks.append(profile)
    ours = cli.impl == "trl_ext" and not cli.control  # the A/A control: TRL's trainer on both sides
    side = build(cli, on_gpu, callbacks, ours, cli.reentrant, cli.keep_input_grads_hook)
    trainer, config = side["trainer"], side["config"]
    figures.trainer = trainer
    frozen, trained = linear_sizes(trainer.model)
    d_attn = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)

    flop_check = flop_counter_check(trainer, meter, frozen, trained, config, d_attn) if cli.flop_check else None
    built = time.perf_counter()
    with kept_input_grads_hook(cli.keep_input_grads_hook):  # trl_ext removes it again at train start
        trainer.train()

    steady = slice(cli.warmup, None) if len(meter.times) > cli.warmup else slice(None)
    times, tokens, lengths = meter.times[steady], meter.tokens[steady], meter.lengths[steady]
    flops = sum(step_flops(t, n, frozen, trained, config.num_hidden_layers, d_attn, cli.trainer == "dpo")["total"]
                for t, n in zip(tokens, lengths))
    result = {
        "impl": cli.impl, "trainer": cli.trainer, "tuning": cli.tuning, "gc": cli.gc,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "params": side["params"], "trained_linear": trained, "frozen_linear": frozen,
        "steps_timed": len(times), "step_s": statistics.median(times), "tokens_per_step": statistics.median(tokens),
        "tokens_per_s": sum(tokens) / sum(times), "model_flops_per_s": flops / sum(times),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
        "peak_mem_bytes": torch.cuda.max_memory_allocated() if on_gpu else None, "held_before_bytes": held_before,
        "flop_check": flop_check, "figures": figures.found, "reentrant": cli.reentrant,
        "keep_input_grads_hook": cli.keep_input_grads_hook, "paired": False,
        "profile": profile.summary if profile else None, "control": cli.control, "repeat": cli.repeat,
        "trainer_class": f"{type(trainer).__module__}.{type(trainer).__name__}",  # the A/A's: TRL's on both sides
        "build_s": built - began,
    }
    output_dir = side["output_dir"]
    del trainer, side, figures, profile, callbacks
    tear_down(output_dir)
    result["run_s"] = time.perf_counter() - began
    return result


class Turns(TrainerCallback):
    """Two trainers in one process, one step each in turn (``_pairing.Baton``): the GPU's queue drained before the
    turn passes, so that each step runs alone, beside the other side's under the same conditions."""

    def __init__(self, name: str, baton: Baton):
        self.name, self.baton = name, baton

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.baton.pass_and_wait(self.name)


def run_paired(cli: argparse.Namespace) -> dict:
    """TRL's trainer and this side (``cli.impl``, its variant flags; ``control``: TRL's trainer too) built in one
    process and trained in two threads that take turns step by step; the ratio is the median over the timed steps (after
    ``--warmup``, the last one left out) of this side's step over TRL's step beside it. Peak memory is not measured
    (both models are held at once)."""
    began = time.perf_counter()
    on_gpu = torch.cuda.is_available() and not cli.smoke
    gc.collect()
    baton = Baton(["trl", "other"])
    sides, figures = {}, {}
    for name in ("trl", "other"):
        figures[name] = Figures()
        callbacks = [Turns(name, baton), StepMeter(), figures[name]]
        ours = name == "other" and cli.impl == "trl_ext" and not cli.control
        variant = name == "other"
        sides[name] = build(cli, on_gpu, callbacks, ours, variant and cli.reentrant,
                            variant and cli.keep_input_grads_hook)
        figures[name].trainer = sides[name]["trainer"]
    built = time.perf_counter()
    with kept_input_grads_hook(cli.keep_input_grads_hook):  # trl_ext removes it again at train start
        train_in_turns({name: side["trainer"] for name, side in sides.items()}, baton)
    # Timed: after the warm-up, and not the last step, beside which the side that finished first tears down ungated
    # (its first steps likewise ran beside the other's set-up)
    times = {name: side["meter"].times[cli.warmup:-1] or side["meter"].times for name, side in sides.items()}
    ratios = [b / a for a, b in zip(times["trl"], times["other"])]
    trainer = sides["other"]["trainer"]
    result = {
        "impl": cli.impl, "trainer": cli.trainer, "tuning": cli.tuning, "gc": cli.gc, "paired": True,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu", "steps_timed": len(ratios),
        "trl_step_s": statistics.median(times["trl"]), "step_s": statistics.median(times["other"]),
        "paired_ratio": statistics.median(ratios), "ratios": ratios,
        "figures": figures["other"].found, "trl_figures": figures["trl"].found, "reentrant": cli.reentrant,
        "keep_input_grads_hook": cli.keep_input_grads_hook, "control": cli.control, "repeat": cli.repeat,
        "profile": None, "trainer_class": f"{type(trainer).__module__}.{type(trainer).__name__}",
        "build_s": built - began,
    }
    output_dirs = [side["output_dir"] for side in sides.values()]
    del trainer
    sides.clear()  # the models and trainers: freed before the teardown gives the memory back
    figures.clear()
    tear_down(*output_dirs)
    result["run_s"] = time.perf_counter() - began
    return result


def emit(cli: argparse.Namespace, result: dict) -> None:
    """One result: printed as a ``BENCH`` line, and appended to ``--results`` when given."""
    line = json.dumps(result)
    print("BENCH " + line, flush=True)
    if cli.results:
        with open(cli.results, "a") as f:
            f.write(line + "\n")


def main():
    cli = parse()
    if not cli.plan:
        emit(cli, run(cli))
        return
    failed = 0
    for workload in json.loads(cli.plan):  # a workload that fails (out of memory...) does not stop the next ones
        try:
            emit(cli, run(argparse.Namespace(**{**vars(cli), **workload})))
        except Exception:  # noqa: BLE001 - reported on its own line; the exit code says it
            failed += 1
            print("BENCH_FAILED " + json.dumps({**workload, "error": traceback.format_exc()[-3000:]}), flush=True)
            for cls in (AcceleratorState, GradientState):
                cls._shared_state.clear()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
