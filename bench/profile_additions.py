"""Where trl_ext's own code spends time: its setup and per-step work against a training step, its save-time
verification against a save. One process, CPU.

    python bench/profile_additions.py [--steps 10] [--saves 3] [--skip_train] [--skip_save]

Training (SFT, Reward, DPO with LoRA r=8 all-linear, the workload of bench/overhead.py; gradient checkpointing off and
on): every trl_ext function that runs at setup is timed (outermost call only), trl_ext's share of the constructor is
the mixin's constructor minus TRL's, and the calls into trl_ext code during two steps are counted with a profiler
hook (``sys.setprofile``, on those two steps only).
Saving (``trl_ext.saving.save``, the path of every final save and checkpoint): a LoRA adapter (r=16, all-linear) on a
Qwen2.5-0.5B-shaped model, and a full 134M-parameter model (bench/save.py's), each saved ``--saves`` times; the
phases are timed: metadata files, stream and write, close the last file, verification, wait for the files' fsync
(the last file's fsync runs during the checks), commit. When that wait is not zero, the checks added nothing to the
save's wall time.
"""

import argparse
import collections
import functools
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import trl  # noqa: E402

import trl_ext  # noqa: E402
from trl_ext.engines import gradient_checkpointing, runtime, sharded
from trl_ext.files import audit, readback, shards
from trl_ext.saving import gather, save_plan
from trl_ext.saving import pipeline as saving
from trl_ext.trainers import configs, mixin, reward_head

TRL_EXT_DIR = str(Path(trl_ext.__file__).parent)
WAIT = "wait for fsync, after the checks"
OUTSIDE_MIXIN = ("runtime.adapt_to_hardware (config)", "reward_head.peft_config_for")


class Timers:
    """Wraps functions in place; counts calls and wall time. Within a group only the outermost call is timed (a
    trl_ext function called by another is not counted twice); groups nest freely (TRL's constructor in ours)."""

    def __init__(self):
        self.total, self.calls = collections.defaultdict(float), collections.Counter()
        self.depth = collections.Counter()

    def wrap(self, owner, attr: str, label: str, group: str = "trl_ext") -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            self.depth[group] += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.depth[group] -= 1
                if self.depth[group] == 0:
                    self.total[label] += time.perf_counter() - start
                    self.calls[label] += 1

        setattr(owner, attr, timed)

    def reset(self):
        self.total.clear()
        self.calls.clear()


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def profile_training(trainer_name: str, gc: bool, cli, timers: Timers) -> dict:
    import _overhead_worker as workload  # the model, data and LoRA config of bench/overhead.py
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        """Step times, and the trl_ext functions called during steps 3 and 4."""

        def __init__(self):
            self.times, self.start, self.step, self.calls = [], None, 0, collections.Counter()

        def _hook(self, frame, event, arg):
            if event == "call" and frame.f_code.co_filename.startswith(TRL_EXT_DIR):
                self.calls[frame.f_code.co_qualname] += 1

        def on_step_begin(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if self.start is not None:
                self.times.append(now - self.start)
            self.step += 1
            sys.setprofile(self._hook if self.step in (3, 4) else None)
            self.start = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            sys.setprofile(None)

    cli.trainer, cli.gc = trainer_name, gc
    probe = Probe()
    timers.reset()
    trainer = workload.build("trl_ext", cli, probe)
    setup = dict(timers.total)
    timers.reset()
    trainer.train()
    at_train = dict(timers.total)
    own_init = setup.get("TrlExtMixin.__init__", 0.0) - setup.get("TRL __init__", 0.0)
    setup_parts = {k: v for k, v in setup.items() if k not in ("TrlExtMixin.__init__", "TRL __init__")}
    # Our work outside the mixin's constructor: the config fix-up, the reward head's PEFT config inside TRL's.
    outside = sum(v for k, v in setup_parts.items() if k in OUTSIDE_MIXIN)
    steady = probe.times[4:] or probe.times  # not steps 1-2 (warm-up) nor 3-4 (under the profiler hook)
    return {"own_init": own_init, "outside": outside, "trl_init": setup.get("TRL __init__", 0.0),
            "setup_parts": setup_parts,
            "train_parts": at_train, "step": statistics.median(steady), "per_step_calls": probe.calls}


def profile_saves(cli, timers: Timers) -> list[dict]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    def qwen_lora():
        qwen = LlamaConfig(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                           num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
        return get_peft_model(LlamaForCausalLM(qwen), LoraConfig(r=16, target_modules="all-linear"))

    def full_134m():
        return LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                            num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                                            tie_word_embeddings=False))

    results = []
    for label, build in (("LoRA adapter r=16, Qwen2.5-0.5B shape", qwen_lora),
                         ("full model, 134M (bench/save.py)", full_134m)):
        torch.manual_seed(0)
        model = build()
        guard = []  # what the save_pretrained guard adds to a user's call
        for _ in range(21):
            guard_start = time.perf_counter()
            sharded.has_partitioned_params(model)
            guard.append(time.perf_counter() - guard_start)
        guard = statistics.median(guard[1:])
        plain = []  # the same weights through save_pretrained (PEFT's or transformers'): no fsync, no verification
        for i in range(cli.saves):
            with tempfile.TemporaryDirectory(prefix="bench-profile-plain-") as tmp:
                start = time.perf_counter()
                model.save_pretrained(f"{tmp}/out{i}")
                plain.append(time.perf_counter() - start)
        runs = []
        for i in range(cli.saves):
            timers.reset()
            with tempfile.TemporaryDirectory(prefix="bench-profile-save-") as tmp:
                saving.save(model, f"{tmp}/out{i}")
                size = sum(f.stat().st_size for f in Path(f"{tmp}/out{i}").rglob("*.safetensors"))
            runs.append(dict(timers.total))
        med = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}
        # The checks run while the last file's fsync is in flight: when the save still had to wait for that fsync
        # after them, they added nothing to its wall time; otherwise at most their own duration.
        added = [0.0 if r.get(WAIT, 0.0) > 1e-4 else r.get("verification", 0.0) for r in runs]
        tensors = sum(len(specs) for ws in save_plan.plan_weight_sets(model) for specs in ws.plan.values())
        results.append({"label": label, "bytes": size, "tensors": tensors, "phases": med, "guard": guard,
                        "plain": statistics.median(plain), "added": statistics.median(added),
                        "hidden": sum(a == 0.0 for a in added), "runs": len(runs)})
        del model
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--trainers", nargs="+", default=["sft", "reward", "dpo"])
    parser.add_argument("--skip_save", action="store_true")
    parser.add_argument("--skip_train", action="store_true")
    cli = parser.parse_args()
    torch.set_num_threads(1)

    timers = Timers()
    # Setup: everything trl_ext runs around TRL's constructor and at train start.
    timers.wrap(mixin.TrlExtMixin, "__init__", "TrlExtMixin.__init__", group="mixin")
    for cls in (trl.SFTTrainer, trl.RewardTrainer, trl.DPOTrainer):
        timers.wrap(cls, "__init__", "TRL __init__", group="trl")
    timers.wrap(configs, "adapt_to_hardware", "runtime.adapt_to_hardware (config)")
    timers.wrap(runtime, "check_distributed_setup", "runtime.check_distributed_setup")
    for name in ("take_user_choice", "decide", "apply", "remove_input_require_grads_hooks"):
        timers.wrap(gradient_checkpointing, name, f"gradient_checkpointing.{name}")
    timers.wrap(gradient_checkpointing.CheckpointingPolicy, "on_train_begin", "CheckpointingPolicy.on_train_begin")
    timers.wrap(mixin, "guard_save_pretrained", "trainers.guard_save_pretrained")
    optional = [(mixin.TrlExtMixin, "_check_input", "input checks (model path, TRL on the first rows)")]
    for module, names in (("data.input_checks", ("check_rows_kept",)),
                          ("resuming.checks", ("check_resume_checkpoint",)),
                          ("engines.quantization", ("prepare", "match_adapter_dtype"))):
        try:
            module = importlib.import_module(f"trl_ext.{module}")
        except ImportError:
            continue
        optional += [(module, name, f"{module.__name__.split('.')[-1]}.{name}") for name in names]
    for owner, name, label in optional:  # newer additions: timed where this checkout has them
        if hasattr(owner, name):
            timers.wrap(owner, name, label)
    timers.wrap(reward_head, "check", "reward_head.check")
    timers.wrap(reward_head, "head_trained_whole", "reward_head.head_trained_whole")
    timers.wrap(reward_head, "peft_config_for", "reward_head.peft_config_for")
    # Saving: the phases of trl_ext.saving.pipeline.save.
    timers.wrap(saving, "save", "save (total)", group="save")
    timers.wrap(save_plan, "_adapter_weight_sets", "names and shard plan", group="phase")
    timers.wrap(save_plan, "_full_weight_set", "names and shard plan", group="phase")
    timers.wrap(gather, "stream", "stream + write", group="phase")
    timers.wrap(shards.ShardStreamWriter, "finish", "close the last file", group="phase")
    timers.wrap(shards.ShardStreamWriter, "wait", WAIT, group="phase")
    timers.wrap(saving, "write_metadata", "metadata files", group="phase")
    timers.wrap(saving, "_check_own_files", "verification", group="phase")
    timers.wrap(saving, "_check_directory", "verification", group="phase")
    timers.wrap(saving.Save, "commit", "commit (rename)", group="phase")
    timers.wrap(readback, "_read_as_planned", "  read back header + 4 KiB/tensor", group="verify")
    timers.wrap(audit, "read_safetensors", "  parse a header that differs", group="verify")
    timers.wrap(audit, "_nonfinite", "  NaN/inf check", group="verify")
    timers.wrap(audit, "_check_adapter", "  adapter checks", group="verify")
    timers.wrap(audit, "_check_full", "  full-model checks", group="verify")
    timers.wrap(readback, "check_adapter_config", "  adapter_config.json check", group="verify")

    workload_args = argparse.Namespace(steps=cli.steps, seq_len=128, hidden=256, layers=4, batch=4, trainer=None,
                                       gc=False, full=False)
    print("== Training: trl_ext's own work (LoRA, hidden 256, 4 layers, sequence 128, batch 4, 1 thread) ==")
    for trainer_name in [] if cli.skip_train else cli.trainers:
        for gc in (False, True):
            r = profile_training(trainer_name, gc, workload_args, timers)
            setup = r["own_init"] + r["outside"] + sum(r["train_parts"].values())
            print(f"\n{trainer_name} gc={'on' if gc else 'off'}: step {ms(r['step'])}; TRL constructor "
                  f"{ms(r['trl_init'])}; trl_ext setup {ms(setup)} once per run = {100 * setup / r['step']:.2f}% "
                  f"of one step")
            print(f"  mixin constructor minus TRL's: {ms(r['own_init'])}; functions timed (outside the mixin: "
                  f"{', '.join(OUTSIDE_MIXIN)}):")
            for label, seconds in sorted(r["setup_parts"].items(), key=lambda kv: -kv[1]):
                print(f"    {label:<45} {ms(seconds):>10}")
            for label, seconds in r["train_parts"].items():
                print(f"  at train start: {label:<30} {ms(seconds):>10}")
            calls = sum(r["per_step_calls"].values()) / 2
            detail = ", ".join(f"{k} x{v / 2:g}" for k, v in r["per_step_calls"].items()) or "none"
            print(f"  trl_ext calls per training step: {calls:g} ({detail})")

    if hasattr(mixin.input_checks, "probe_datasets"):
        from datasets import Dataset

        from trl_ext.assets import default_model_path

        rows = 20_000
        conversation = [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "42"}]
        for trainer_cls, config_cls, kind, dataset in (
                (trl.SFTTrainer, trl_ext.SFTConfig, "sft", Dataset.from_dict({"messages": [conversation] * rows})),
                (trl.DPOTrainer, trl_ext.DPOConfig, "preference",
                 Dataset.from_dict({"prompt": ["12 + 30 ="] * rows, "chosen": ["42"] * rows,
                                    "rejected": ["41"] * rows}))):
            args = config_cls(output_dir=tempfile.mkdtemp(), report_to="none")
            times = []
            for _ in range(5):
                start = time.perf_counter()
                mixin.input_checks.probe_datasets(trainer_cls, {"train_dataset": dataset}, args,
                                                     default_model_path(), kind=kind)
                times.append(time.perf_counter() - start)
            print(f"\ninput_checks.probe_datasets ({trainer_cls.__name__}, {rows} rows; TRL prepares the first "
                  f"{mixin.input_checks.PROBE_ROWS}, tokenizer load included): median of 5 "
                  f"{ms(statistics.median(times))}, once per run")

    if cli.skip_save:
        return
    print("\n== Saving: trl_ext.saving.pipeline.save, one process ==")
    for r in profile_saves(cli, timers):
        total = r["phases"]["save (total)"]
        print(f"\n{r['label']}: {r['bytes'] / 2**20:.1f} MiB in {r['tensors']} tensors; median of {cli.saves} saves")
        for label, seconds in r["phases"].items():
            print(f"  {label:<32} {ms(seconds):>11}  {100 * seconds / total:6.2f}%")
        print(f"  the checks ran during the last file's fsync, which was still going on after them in {r['hidden']} of "
              f"{r['runs']} saves; added to the save's wall time: {ms(r['added'])} ({100 * r['added'] / total:.2f}%)")
        print(f"  for comparison, save_pretrained (no fsync, no verification): {ms(r['plain'])}")
        print(f"  save_pretrained guard check (per user call): {ms(r['guard'])}")


if __name__ == "__main__":
    main()
