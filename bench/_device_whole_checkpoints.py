"""Whole checkpoints of a full fine-tune on one GPU (launched by bench/device_check.py): SFT of a ~0.5B
Qwen2.5-shaped Llama (random weights) in bf16, as TRL's examples load models (``dtype=bfloat16``), with AdamW (its
states in bf16 too: 3 GB a checkpoint), a ``checkpoint-N`` every ``--save_steps`` steps. Three runs in this process,
one after another:

1. ``foreground``: checkpoints written in the foreground (Trainer's loop waits for each): the anchor;
2. ``background``: the same run with ``save_in_background`` (the last checkpoint is written in the foreground, as
   always), its checkpoints due faster than the disk writes them (the ``faster`` case of bench/_checkpoint_cases.py;
   measured, and failed when the interval turns out longer than the write);
3. ``spaced``: the save interval picked from the write time measured by runs 1 and 2, at least twice it
   (``_checkpoint_cases.pick_interval``), three checkpoints (the ``spaced`` case);
4. ``resumed``: the background run resumed from its last background checkpoint (``checkpoint-K``) and trained to the
   end.

Measured per run: each step's start and end (``time.monotonic``; the GPU synchronised at each step's end, not at its
start, so GPU work a checkpoint queued, such as copies on the compute stream, counts in the step it delays), each
``_save_checkpoint`` call, and so how long each checkpoint held training: the gap from the end of its step to the start
of the next, less the median gap after steps without a checkpoint (logging). Steps "in flight" are those that overlap
a background save (its ``started`` to ``finished`` events). Also kept: the ``checkpoint/*`` costs trl_ext logs for each
checkpoint (``trainer.checkpoints.history``), and each step's loss.

Checked: the two runs are deterministic (the same losses), each background checkpoint holds the same tensors as the
foreground's (weights, optimizer, scheduler and RNG states) and passes trl_ext's audit, and the resumed run gives the
background run's losses and final weights exactly. For the fresh-process reload (bench/_device_reload.py) it writes
the foreground model's outputs on fixed inputs at ``checkpoint-K``. Deterministic kernels: cuBLAS's fixed workspace,
``torch.use_deterministic_algorithms`` (warnings only: a non-deterministic op is named in the log) and eager attention
(PyTorch's flash attention backward is not deterministic).

Writes ``--report`` (JSON) and prints the table. ``--smoke``: a 2-layer model, fp32 on the CPU, 4 steps. ``--cpu``: a
70M model on the CPU, whose checkpoints (0.8 GB) take seconds to write: the cases measured without a GPU. The learning
rate (1e-4) is high enough for Adam's bf16 updates to change bf16 weights (lower ones round away), so the comparisons
compare something.
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: cuBLAS's deterministic workspace

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: _gpu_worker
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.saved_compare

import _checkpoint_cases
import torch
from _gpu_worker import SHAPE_0P5B, SHAPE_SMOKE, data
from accelerate.state import AcceleratorState, GradientState
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, TrainerCallback

import trl_ext
from tests.saved_compare import same_checkpoint
from trl_ext.assets import default_model_path
from trl_ext.files.audit import audit

# What trl_ext logs per checkpoint (when it does): how long it held training, split into the foreground save and the
# wait for the previous copy; the background write's duration and the checkpoint's size.
LOGGED = ("checkpoint/held_s", "checkpoint/held_save_s", "checkpoint/held_copy_wait_s", "checkpoint/held_previous_s",
          "checkpoint/write_s", "checkpoint/bytes")
PROBE_IDS = [[10 + i for i in range(12)], [40 + 3 * i for i in range(12)]]  # as bench/_device_reload.py


def probe(model) -> list:
    """The model's logits on the probe inputs: eval mode, its own dtype (as a reload computes them)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        ids = torch.tensor(PROBE_IDS, device=next(model.parameters()).device)
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().cpu().tolist()
    model.train(was_training)
    return out


class Clock(TrainerCallback):
    """Each optimizer step's (step, start, end), and optionally the model's probe outputs when checkpoint-``probe_at``
    is saved."""

    def __init__(self, cuda: bool, probe_at: int | None = None):
        self.cuda, self.probe_at, self.steps, self.probes, self._start = cuda, probe_at, [], None, None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        self.steps.append((state.global_step, self._start, time.monotonic()))

    def on_save(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.probe_at:
            self.probes = probe(model)


def timed(owner, name: str, record: list, clock=time.monotonic) -> None:
    """Wrap ``owner.name`` so that each call appends (start, end) to ``record``."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = clock()
        try:
            return original(*args, **kwargs)
        finally:
            record.append((start, clock()))

    setattr(owner, name, wrapper)


# --cpu: 70M parameters (the embedded tokenizer's vocabulary fits 512), AdamW in fp32: 0.8 GB a checkpoint
SHAPE_CPU = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=512, tie_word_embeddings=True)


# --smoke: 2 layers as bench/_gpu_worker.py's smoke model, wider, so that a checkpoint (0.1 GB) takes longer to write
# and sync than a step takes (the faster case)
SHAPE_SMOKE_CHECKPOINTS = {**SHAPE_SMOKE, "hidden_size": 512, "intermediate_size": 2048}


def build(cli, tokenizer, on_gpu: bool):
    shape = SHAPE_SMOKE_CHECKPOINTS if cli.smoke else SHAPE_CPU if cli.cpu else SHAPE_0P5B
    config = LlamaConfig(max_position_embeddings=2 * cli.seq_len, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **shape)
    config._attn_implementation = "eager"  # deterministic backward (see the module docstring)
    torch.manual_seed(0)
    with torch.device("cuda" if on_gpu else "cpu"):
        return LlamaForCausalLM(config).to(torch.bfloat16 if on_gpu else torch.float32)


def train(cli, name: str, tokenizer, on_gpu: bool, background: bool, resume_from: str | None = None,
          probe_at: int | None = None, save_steps: int | None = None) -> dict:
    """One run (``save_steps`` apart, 3 checkpoints; default ``--save_steps``, ``--steps``); returns what it measured
    (see the module docstring)."""
    out = Path(cli.work) / name
    save_steps = save_steps or cli.save_steps
    steps = cli.steps if save_steps == cli.save_steps else 3 * save_steps
    args = trl_ext.SFTConfig(
        output_dir=str(out), max_steps=steps, save_strategy="steps", save_steps=save_steps,
        per_device_train_batch_size=cli.batch, max_length=cli.seq_len, learning_rate=1e-4, logging_steps=1,
        report_to="none", seed=0, gradient_checkpointing=False, bf16=on_gpu, dataloader_num_workers=0,
        optim="adamw_torch_fused" if on_gpu else "adamw_torch", save_in_background=background,
    )
    clock = Clock(on_gpu, probe_at)
    trainer = trl_ext.SFTTrainer(model=build(cli, tokenizer, on_gpu), args=args, processing_class=tokenizer,
                                 train_dataset=data("sft", cli.seq_len, rows=steps * cli.batch),
                                 callbacks=[clock])
    saves, reserve = [], []
    timed(trainer, "_save_checkpoint", saves)
    checkpoints = getattr(trainer, "checkpoints", None)
    if checkpoints is not None and hasattr(checkpoints, "reserve"):
        timed(checkpoints, "reserve", reserve)
    start = time.monotonic()
    trainer.train(resume_from_checkpoint=resume_from)
    total = time.monotonic() - start
    if on_gpu:
        torch.cuda.synchronize()
    executor = getattr(checkpoints, "executor", None)
    events = list(getattr(executor, "events", None) or [])
    history = trainer.state.log_history
    last = getattr(checkpoints, "last", None)
    found = {
        "name": name, "output_dir": str(out), "background": background, "total_s": total, "save_steps": save_steps,
        "steps": clock.steps, "saves": saves, "reserve_s": sum(b - a for a, b in reserve),
        "windows": windows(events), "logged": [{k: v for k, v in cost.metrics().items() if k in LOGGED}
                                              for cost in getattr(checkpoints, "history", [])],
        "losses": {str(e["step"]): e["loss"] for e in history if "loss" in e and "step" in e},
        "probes": clock.probes, "checkpoints": sorted(p.name for p in out.glob("checkpoint-*")),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
        "snapshot_bytes": getattr(last, "weight_bytes", None),
    }
    found["summary"] = summarise(found, save_steps, steps)
    del trainer, clock
    for cls in (AcceleratorState, GradientState):  # the next run builds its own accelerator
        cls._shared_state.clear()
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return found


def windows(events: list) -> list:
    """(started, finished) of each background save, from the saves' executor's events (time.monotonic)."""
    spans, started = [], {}
    for event in events:
        kind, target, when = event[0], event[1], event[2]
        if kind == "started":
            started[target] = when
        elif kind == "finished" and target in started:
            spans.append((started.pop(target), when))
    return spans


def summarise(run: dict, save_steps: int, last: int) -> dict:
    """Each checkpoint's hold, and the step times with and without a background save in flight."""
    steps = {s: (a, b) for s, a, b in run["steps"]}
    checkpoint_steps = [s for s in steps if s % save_steps == 0 or s == last]
    gaps = {s: steps[s + 1][0] - steps[s][1] for s in steps if s + 1 in steps}
    plain = [g for s, g in gaps.items() if s not in checkpoint_steps and s > 1]  # step 1's gap: the reserve
    baseline = statistics.median(plain) if plain else 0.0
    calls = [b - a for a, b in run["saves"]]
    held = []
    for i, s in enumerate(checkpoint_steps):
        if s in gaps:
            held.append(max(gaps[s] - baseline, 0.0))
        elif i < len(calls):  # the last checkpoint: nothing trains after it; its save call
            held.append(calls[i])
    durations = {s: b - a for s, (a, b) in steps.items()}
    in_flight = [s for s, (a, b) in steps.items() if any(a < end and b > begin for begin, end in run["windows"])]
    others = [d for s, d in durations.items() if s not in in_flight and s > 2]  # steps 1-2: warm-up
    # The step right after each checkpoint but the last: it carries what the save left queued on the GPU (copies on
    # the compute stream run before its kernels); a writer thread slowing training shows in every step in flight.
    after = [durations[s + 1] for s in checkpoint_steps if s + 1 in durations]
    return {
        "checkpoint_steps": checkpoint_steps, "held_s": held, "save_call_s": calls, "gap_baseline_s": baseline,
        "step_after_checkpoint_s": statistics.median(after) if after else None,
        "step_s": statistics.median(others) if others else None,
        "in_flight_steps": in_flight, "in_flight_step_s": statistics.median(durations[s] for s in in_flight)
        if in_flight else None,
        "write_s": [b - a for a, b in run["windows"]],
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True, help="a directory for the runs' checkpoints (several GB each)")
    parser.add_argument("--report", required=True)
    # a checkpoint every 10 steps of ~0.17 s on the H200: faster than its 3.7-s write (the faster case)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save_steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 model on the CPU, 4 steps")
    parser.add_argument("--cpu", action="store_true", help="a 70M fp32 model on the CPU, 6 steps, 0.8 GB checkpoints")
    cli = parser.parse_args()
    if cli.smoke:  # a checkpoint every step: its writes take longer than a step
        cli.steps, cli.save_steps, cli.batch, cli.seq_len = 4, 1, 1, 32  # 3 in the background: 2 that may wait
    elif cli.cpu:
        cli.steps, cli.save_steps, cli.batch, cli.seq_len = 6, 2, 2, 64
    assert cli.steps % cli.save_steps == 0 and cli.steps // cli.save_steps >= 3, "need 2 background checkpoints"
    on_gpu = torch.cuda.is_available() and not (cli.smoke or cli.cpu)
    torch.use_deterministic_algorithms(True, warn_only=True)
    # Deterministic kernels only: filling every new tensor (3 GB of pinned copies included) would distort the timings
    torch.utils.deterministic.fill_uninitialized_memory = False
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    last_background = cli.steps - cli.save_steps
    report = {"steps": cli.steps, "save_steps": cli.save_steps, "batch": cli.batch, "seq_len": cli.seq_len,
              "device": torch.cuda.get_device_name() if on_gpu else "cpu", "checks": {}}

    def write():
        Path(cli.report).write_text(json.dumps(report))

    runs = report["runs"] = {}
    runs["foreground"] = train(cli, "foreground", tokenizer, on_gpu, background=False, probe_at=last_background)
    shutil.rmtree(Path(runs["foreground"]["output_dir"]) / f"checkpoint-{cli.steps}", ignore_errors=True)  # unused
    write()
    runs["background"] = train(cli, "background", tokenizer, on_gpu, background=True)
    write()
    # the spaced case: its interval from the slowest write measured so far, in the foreground or the background (on a
    # CPU a write beside training is slower than alone)
    write_s = max([e["checkpoint/write_s"] for e in runs["foreground"]["logged"]]
                  + runs["background"]["summary"]["write_s"])
    step_s = runs["foreground"]["summary"]["step_s"]
    report["spaced"] = {"write_s": write_s, "step_s": step_s, "save_steps": _checkpoint_cases.pick_interval(write_s,
                                                                                                          step_s)}
    runs["spaced"] = train(cli, "spaced", tokenizer, on_gpu, background=True,
                           save_steps=report["spaced"]["save_steps"])
    shutil.rmtree(runs["spaced"]["output_dir"], ignore_errors=True)  # timed, not compared: the background run is
    report["cases"] = {name: _checkpoint_cases.case(runs[run], runs["foreground"])
                       for name, run in (("spaced", "spaced"), ("faster", "background"))}
    write()
    fg, bg = (Path(runs[n]["output_dir"]) for n in ("foreground", "background"))
    checks = report["checks"]
    checks["deterministic"] = [f"step {s}: {loss} != {runs['background']['losses'].get(s)}"
                               for s, loss in runs["foreground"]["losses"].items()
                               if runs["background"]["losses"].get(s) != loss]
    for step in range(cli.save_steps, cli.steps, cli.save_steps):  # the background checkpoints
        name = f"checkpoint-{step}"
        result = audit(str(bg / name))
        checks[f"audit {name}"] = [] if result.ok else [result.format()]
        checks[f"{name} as foreground's"] = same_checkpoint(fg / name, bg / name)
        if step != last_background:
            shutil.rmtree(fg / name, ignore_errors=True)  # several GB each
    write()
    runs["resumed"] = train(cli, "resumed", tokenizer, on_gpu, background=True,
                            resume_from=str(bg / f"checkpoint-{last_background}"))
    # the resumed run's log history starts with the checkpoint's: its own steps are those after it
    resumed = {s: loss for s, loss in runs["resumed"]["losses"].items() if int(s) > last_background}
    checks["resumed losses"] = [f"step {s}: {loss} != {runs['background']['losses'].get(s)}"
                                for s, loss in resumed.items() if runs["background"]["losses"].get(s) != loss]
    if sorted(map(int, resumed)) != list(range(last_background + 1, cli.steps + 1)):
        checks["resumed losses"].append(f"steps logged after the resume: {sorted(map(int, resumed))}")
    final = f"checkpoint-{cli.steps}"
    checks["resumed final checkpoint"] = same_checkpoint(bg / final, Path(runs["resumed"]["output_dir"]) / final)
    report["reload"] = {"path": str(bg / f"checkpoint-{last_background}"), "probes": runs["foreground"]["probes"],
                        "dtype": "bfloat16" if on_gpu else "float32", "attn": "eager"}
    shutil.rmtree(fg, ignore_errors=True)
    write()
    print(json.dumps({name: run["summary"] for name, run in runs.items()}, indent=1))
    print(json.dumps(checks, indent=1))
    import _device_steps  # the device check's table of this report (tests.saved_compare: the repository is on the path)

    print("\n".join(_device_steps.checkpoint_table(report)))


if __name__ == "__main__":
    main()
