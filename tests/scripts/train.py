"""Train one of the three trainers on the embedded model and data; write what happened to a JSON file.

Run alone (single process) or under ``accelerate launch`` (see ``tests/harness.py``). Records per-step losses and,
under DeepSpeed, proof that ZeRO-3 really partitioned the parameters.
"""

import argparse
import contextlib
import errno
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import save_file
from transformers import TrainerCallback

import trl_ext
from trl_ext.assets import default_model_path, load_default_dataset
from trl_ext.engines.gradient_checkpointing import layer_settings
from trl_ext.files import shards
from trl_ext.process.ranks import env_rank
from trl_ext.saving import deferred

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository's tests package
import launched  # noqa: E402 - tests/scripts/, beside this file

from tests.probes import weight_reads  # noqa: E402
from tests.probes.copy_order import CopyOrder  # noqa: E402
from tests.probes.gather_count import GatherCount, model_numel  # noqa: E402
from tests.probes.tensor_peak import step_peaks  # noqa: E402

TRAINERS = {
    "sft": (trl_ext.SFTTrainer, trl_ext.SFTConfig, "sft"),
    "reward": (trl_ext.RewardTrainer, trl_ext.RewardConfig, "reward"),
    "dpo": (trl_ext.DPOTrainer, trl_ext.DPOConfig, "preference"),
}


def retyped(splits, data: str):
    """The bundled SFT conversations as plain text (``user assistant``) or as prompt-completion text."""
    def row(messages):
        prompt, answer = messages[0]["content"], messages[1]["content"]
        return {"text": f"{prompt} {answer}"} if data == "text" else {"prompt": f"{prompt} ", "completion": answer}

    return splits.map(lambda r: row(r["messages"]), remove_columns=["messages"])


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
            # Partitioning is read here, before any evaluation: ZeRO-3 may keep parameters gathered after an eval
            # pass (its prefetch cache) until the next training step.
            self.seen = {"layers": layer_settings(model), "input_hooks": len(hooks),
                         "partition": partition_report(model)}


def gathered_trainable(model) -> dict:
    """Full trainable weights, on every rank (call it on every rank). Under ZeRO-3 each parameter is rebuilt from
    every rank's partition (``ds_tensor``, which the optimizer step updates) with one all-gather, not with DeepSpeed's
    ``GatheredParameters``: that skips a parameter whose prefetch is still in flight and hands back its buffer before
    the all-gather has filled it (DeepSpeed 0.19.2, even after ``empty_partition_cache``: a weight of 1.7e38 or 3e17
    in a run whose losses and Adam states matched to the bit)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if any(isinstance(p, torch.distributed.tensor.DTensor) for p in params.values()):  # FSDP2: collective per tensor
        return {n: p.full_tensor().detach().cpu().clone().contiguous() for n, p in params.items()}
    return {n: _zero3_full(p) if hasattr(p, "ds_tensor") else p.detach().cpu().clone().contiguous()
            for n, p in params.items()}


def _zero3_full(param) -> torch.Tensor:
    group = param.ds_process_group
    part = param.ds_tensor.detach().reshape(-1)
    parts = [torch.empty_like(part) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, part, group=group)  # equal, zero-padded parts, in rank order
    return torch.cat(parts)[: param.ds_numel].view(param.ds_shape).cpu().clone()


class KillAtStep(TrainerCallback):
    """Die like a preempted or OOM-killed job: SIGKILL (no cleanup, no flush) at the end of optimizer step ``step``,
    on every rank or only on ``rank``."""

    def __init__(self, step: int, rank: int | None):
        self.step, self.rank = step, rank

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.rank in (None, args.process_index):
            print(f"[train.py] rank {args.process_index} SIGKILLs itself at step {self.step} (t={time.time():.3f})",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class RaiseAtStep(TrainerCallback):
    """A bug in training: ``KeyError`` at the end of optimizer step ``step``, on every rank or only on ``rank``."""

    def __init__(self, step: int, rank: int | None):
        self.step, self.rank = step, rank

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.rank in (None, args.process_index):
            raise KeyError(f"a bug at step {self.step}")


class SignalAtStep(TrainerCallback):
    """A scheduler preempting the job: ``signum`` to this process while optimizer step ``step`` runs, on every rank or
    only on ``rank``."""

    def __init__(self, step: int, rank: int | None, signum: int):
        self.step, self.rank, self.signum = step, rank, signum

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step and self.rank in (None, args.process_index):
            print(f"[train.py] rank {args.process_index} gets signal {self.signum} in step {self.step}", flush=True)
            os.kill(os.getpid(), self.signum)


def signal_during_save(step: int, rank: int | None, signum: int) -> None:
    """``signum`` to this process (every rank, or only ``rank``) once the first tensor of checkpoint-``step`` is
    written: a preemption that arrives during a save."""
    end, sent = shards.ShardStreamWriter.end, []

    def write_then_signal(self):
        end(self)
        if f"checkpoint-{step}" in str(self.directory) and not sent and rank in (None, env_rank()):
            sent.append(True)
            print(f"[train.py] rank {env_rank()} gets signal {signum} while checkpoint-{step} is written", flush=True)
            os.kill(os.getpid(), signum)

    shards.ShardStreamWriter.end = write_then_signal


class SlowSteps(TrainerCallback):
    """Every optimizer step takes at least ``seconds`` (a run that outlasts a store's outage)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_begin(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


@contextlib.contextmanager
def slow_uploads(seconds: float):
    """Inside the block, every file a checkpoint mirror uploads takes ``seconds`` longer (an upload that a test can
    interrupt)."""
    from trl_ext.mirror.store import Store

    upload = Store.upload

    def slow(self, local, rel, cancelled=lambda: False):
        time.sleep(seconds)
        return upload(self, local, rel, cancelled)

    Store.upload = slow
    try:
        yield
    finally:
        Store.upload = upload


def kill_during_upload(step: int, peers: list[int]) -> None:
    """Once the checkpoint mirror has uploaded the first file of checkpoint-``step``, the uploading rank SIGKILLs every
    other rank and then itself: a machine lost mid-upload."""
    from trl_ext.mirror.store import Store

    upload = Store.upload

    def upload_then_die(self, local, rel, cancelled=lambda: False):
        result = upload(self, local, rel, cancelled)
        if rel.startswith(f"checkpoint-{step}/"):
            print(f"[train.py] rank {env_rank()} SIGKILLs every rank while checkpoint-{step} is uploaded", flush=True)
            for pid in peers:
                if pid != os.getpid():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    Store.upload = upload_then_die


class CountSteps(TrainerCallback):
    """Optimizer steps this process ran (a resumed run runs only those after its checkpoint), and when each ended."""

    def __init__(self):
        self.steps, self.ends = 0, []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1
        self.ends.append(time.time())


def kill_every_rank_during_save(step: int, peers: list[int], states: bool = False) -> None:
    """While checkpoint-``step``'s weights are being written (first tensor done), or with ``states`` while a rank's
    optimizer states are (its first file written), that rank SIGKILLs every other rank and then itself: a whole job
    preempted mid-save."""
    end, write_synced, write_dcp = shards.ShardStreamWriter.end, deferred.write_synced, deferred._write_dcp

    def die():
        for pid in peers:
            if pid != os.getpid():
                os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def write_then_die(self):
        end(self)
        if f"checkpoint-{step}" in str(self.directory):
            die()

    def write_state_then_die(write, path):
        failure = write_synced(write, path)
        if f"checkpoint-{step}" in path and "optim" in Path(path).name:
            die()
        return failure

    def write_dcp_then_die(save, state_dict, kwargs):
        failure = write_dcp(save, state_dict, kwargs)
        if f"checkpoint-{step}" in str(kwargs["storage_writer"].path):
            die()
        return failure

    if states:
        deferred.write_synced, deferred._write_dcp = write_state_then_die, write_dcp_then_die
    else:
        shards.ShardStreamWriter.end = write_then_die


class HoldSave(TrainerCallback):
    """A background save provably overlaps training: the writer of checkpoint-``step``'s weights and each rank's writer
    of its optimizer states wait, before they finish, until optimizer step ``until`` has ended on their rank (if
    training waited for the save, it never would: the save fails after 120 s); and that step's end waits until one of
    them waits, so the order is the same on a loaded machine as on an idle one. Records each step's end and each wait,
    with times, for the report."""

    def __init__(self, step: int, until: int):
        self.step, self.until, self.reached, self.events = step, until, threading.Event(), []
        self.waiting = threading.Event()
        finish, write_synced, write_dcp = shards.ShardStreamWriter.finish, deferred.write_synced, deferred._write_dcp

        def hold(what: str) -> None:
            if not self.reached.is_set():
                self.events.append((f"{what}_waits", step, time.monotonic()))
                self.waiting.set()
                if not self.reached.wait(120):
                    raise RuntimeError(f"no step ended while checkpoint-{step}'s {what} was being written")

        def held_finish(writer):
            if f"checkpoint-{step}" in str(writer.directory):
                hold("writer")
            finish(writer)

        def held_write(write, path):  # torch.save'd states: DeepSpeed's ZeRO partitions, Trainer's optimizer.pt
            if f"checkpoint-{step}" in path and "optim" in Path(path).name:
                hold("optimizer")
            return write_synced(write, path)

        def held_dcp(save, state_dict, kwargs):  # FSDP2's sharded optimizer states
            if f"checkpoint-{step}" in str(kwargs["storage_writer"].path):
                hold("optimizer")
            return write_dcp(save, state_dict, kwargs)

        shards.ShardStreamWriter.finish = held_finish
        deferred.write_synced, deferred._write_dcp = held_write, held_dcp

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.until and not self.waiting.wait(120):
            raise RuntimeError(f"step {self.until} ended and no writer of checkpoint-{self.step} was being held")
        self.events.append(("step_end", state.global_step, time.monotonic()))
        if state.global_step == self.until:
            self.reached.set()


def fail_writes(step: int, code: str) -> None:
    """Simulate a disk that fills up (ENOSPC) or a directory that becomes read-only (EACCES) under the writer, while
    checkpoint-``step`` is written."""
    append = shards.ShardStreamWriter.append

    def failing_append(self, piece):
        if f"checkpoint-{step}" in str(self.directory):
            number = getattr(errno, code)
            raise OSError(number, os.strerror(number))
        append(self, piece)

    shards.ShardStreamWriter.append = failing_append


def innermost_optimizer(optimizer):
    """The torch optimizer under accelerate's and DeepSpeed's wrappers (holds this rank's Adam state)."""
    while not isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def optimizer_state(optimizer) -> dict:
    state = {}  # by position: ZeRO-3 swaps its flat partitions in and out of param_groups
    for i, param_state in enumerate(innermost_optimizer(optimizer).state.values()):
        for key, value in param_state.items():
            if isinstance(value, torch.distributed.tensor.DTensor):  # FSDP2: this rank's shard
                value = value.to_local()
            state[f"{i}.{key}"] = torch.as_tensor(value).detach().float().cpu().reshape(-1).clone().contiguous()
    return state


def full_optimizer_state(model, optimizer=None) -> dict:
    """Each trainable parameter's whole Adam state, by name: comparable across numbers of processes and engines.
    Under ZeRO from DeepSpeed's partitions; otherwise (FSDP2 shards, one process) through torch's full state dict.
    Collective: every rank calls it."""
    if optimizer is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer),
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {f"{name}.{key}": value.detach().clone().contiguous() for name, per in full.get("state", {}).items()
                for key, value in per.items() if key in ("exp_avg", "exp_avg_sq")}  # rank 0's; others: empty
    from deepspeed.utils import safe_get_full_optimizer_state

    state = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            for key in ("exp_avg", "exp_avg_sq"):
                state[f"{name}.{key}"] = safe_get_full_optimizer_state(param, key).detach().cpu().clone().contiguous()
    return state


def record_samples(trainer) -> list:
    """The samples each micro-batch trained on, as one id per row (a hash of its tokens): the data order seen."""
    seen, step = [], trainer.training_step

    def recording_step(model, inputs, *args, **kwargs):
        seen.append([hash(tuple(row.tolist())) for row in inputs["input_ids"]])
        return step(model, inputs, *args, **kwargs)

    trainer.training_step = recording_step
    return seen


PROBE_IDS = [[10 + i for i in range(12)], [40 + 3 * i for i in range(12)]]  # as tests/scripts/reload.py


def probe_outputs(model) -> list:
    """Logits (causal LM) or rewards on fixed inputs, in eval mode (on the model's device: a GPU's too)."""
    model.eval()
    with torch.no_grad():
        ids = torch.tensor(PROBE_IDS, device=next(model.parameters()).device)
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().cpu().tolist()
    model.train()
    return out


def quantized_init_kwargs(cli) -> dict:
    """What the recipes pass for --load_in_4bit: trl.get_quantization_config's config, with dtype, no device_map."""
    from transformers import BitsAndBytesConfig

    dtype = cli.dtype or "float32"
    config = {"load_in_4bit": True, "bnb_4bit_quant_type": cli.bnb_4bit_quant_type, "bnb_4bit_compute_dtype": dtype}
    if cli.bnb_4bit_quant_storage:
        config["bnb_4bit_quant_storage"] = cli.bnb_4bit_quant_storage
    return {"dtype": dtype,
            "quantization_config": config if cli.quant_config_as == "dict" else BitsAndBytesConfig(**config)}


def quantization_report(model) -> dict:
    """The 4-bit weights' storage dtype and the dtypes of the trainable and frozen floating parameters."""
    # By module: FSDP2 turns every parameter into a DTensor, Params4bit included (the layer keeps its quant_state)
    four_bit = [m.weight for m in model.modules() if type(m).__name__ == "Linear4bit"]
    others = [p for p in model.parameters() if all(p is not w for w in four_bit)]
    return {
        "num_4bit": len(four_bit),
        "storage": sorted({str(p.dtype) for p in four_bit}),
        "trainable": sorted({str(p.dtype) for p in others if p.requires_grad}),
        "frozen_float": sorted({str(p.dtype) for p in others if not p.requires_grad and p.is_floating_point()}),
    }


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=TRAINERS, required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=3)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--gc", choices=GC_MODES, default="default")
    parser.add_argument("--tensor_peak", action="store_true",
                        help="report each step's peak of live tensor bytes (tests/probes/tensor_peak.py)")
    parser.add_argument("--grad_accum", type=int, default=1)
    parser.add_argument("--batch", type=int, default=2, help="per_device_train_batch_size")
    parser.add_argument("--save_steps", type=int, default=0, help="checkpoint every N steps (default: no checkpoints)")
    parser.add_argument("--resume", action="store_true", help="resume_from_checkpoint=True (the last checkpoint)")
    parser.add_argument("--resume_from", default=None, help="resume_from_checkpoint=PATH")
    parser.add_argument("--save_on_each_node", action="store_true")
    parser.add_argument("--kill_at_step", type=int, default=0, help="SIGKILL every rank (or --kill_rank) at this step")
    parser.add_argument("--kill_rank", type=int, default=None)
    parser.add_argument("--raise_at_step", type=int, default=0, help="a bug: KeyError on --kill_rank (or every rank)")
    parser.add_argument("--kill_during_save", type=int, default=0,
                        help="SIGKILL every rank while checkpoint-N is written")
    parser.add_argument("--kill_during_states_save", type=int, default=0,
                        help="SIGKILL every rank while checkpoint-N's optimizer states are written (in the background)")
    parser.add_argument("--fail_save", type=int, default=0, help="the writer fails (--fail_errno) on checkpoint-N")
    parser.add_argument("--signal_at_step", type=int, default=0, help="send --signal while step N runs")
    parser.add_argument("--signal_during_save", type=int, default=0, help="send --signal while checkpoint-N is written")
    parser.add_argument("--signal", default="SIGTERM", choices=["SIGTERM", "SIGUSR1"])
    parser.add_argument("--signal_rank", type=int, default=None, help="only this rank gets the signal")
    parser.add_argument("--fail_errno", default="ENOSPC", choices=["ENOSPC", "EACCES"])
    parser.add_argument("--hold_save", type=int, nargs=2, default=None, metavar=("N", "M"),
                        help="checkpoint-N's writers (weights, optimizer states) wait until step M has ended "
                             "(save_in_background)")
    parser.add_argument("--slow_copy", type=int, default=0, help="checkpoint-N's copies wait until the next step's "
                        "backward has begun (save_in_background; tests/probes/copy_order.py)")
    parser.add_argument("--unguarded_copy", type=int, default=0, help="checkpoint-N's copies run after the next "
                        "optimizer step, whose wait for them is removed: the checkpoint must differ")
    parser.add_argument("--slow_steps", type=float, default=0.0, help="each step takes at least this many seconds")
    parser.add_argument("--slow_uploads", type=float, default=0.0,
                        help="each file the checkpoint mirror uploads takes this many seconds longer")
    parser.add_argument("--kill_during_upload", type=int, default=0,
                        help="SIGKILL every rank once the mirror has uploaded a file of checkpoint-N")
    parser.add_argument("--load_in_4bit", action="store_true", help="QLoRA: a BitsAndBytesConfig in model_init_kwargs")
    parser.add_argument("--bnb_4bit_quant_type", default="nf4", choices=["nf4", "fp4"])
    parser.add_argument("--bnb_4bit_quant_storage", default=None, help="default: bitsandbytes' (uint8)")
    parser.add_argument("--quant_config_as", default="object", choices=["object", "dict"], help="as YAML would give it")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="the model's dtype (model_init_kwargs); with --load_in_4bit also the compute dtype "
                             "(default: the checkpoint's; float32 with --load_in_4bit)")
    parser.add_argument("--eval_steps", type=int, default=0, help="evaluate on 4 test rows every N steps")
    parser.add_argument("--record_loading", action="store_true", help="write each rank's bytes read from model files "
                        "to weight_reads_rankR.json, and the reference model's gathered weights to ref.safetensors")
    parser.add_argument("--config_json", default="{}", help="more config fields, as JSON (TRL's training options; "
                        "they override the defaults above, learning_rate included)")
    parser.add_argument("--data", default=None, choices=["text", "prompt-completion"],
                        help="SFT data in another type: plain text, or prompt-completion (default: the trainer's)")
    parser.add_argument("--save_model", default=None, help="trainer.save_model(OUTPUT_DIR/NAME) after training, and "
                        "the trained model's probe outputs to OUTPUT_DIR/probes_NAME.json")
    cli = parser.parse_args(argv)
    if cli.fail_save:
        fail_writes(cli.fail_save, cli.fail_errno)

    if cli.record_loading:
        weight_reads.install()
        weight_reads.READS.clear()
    trainer_cls, config_cls, data_kind = TRAINERS[cli.trainer]
    splits = load_default_dataset(data_kind)
    if cli.data:
        splits = retyped(splits, cli.data)
    dataset = splits["train"].select(range(cli.rows))
    eval_dataset = splits["test"].select(range(4)) if cli.eval_steps else None
    settings = dict(
        output_dir=cli.output_dir,
        max_steps=cli.max_steps,
        per_device_train_batch_size=cli.batch,
        gradient_accumulation_steps=cli.grad_accum,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="steps" if cli.save_steps else "no",
        eval_strategy="steps" if cli.eval_steps else "no",
        eval_steps=cli.eval_steps or None,
        per_device_eval_batch_size=2,
        save_steps=cli.save_steps or 500,
        save_on_each_node=cli.save_on_each_node,
        report_to="none",
        seed=0,
        dataloader_num_workers=0,
        **GC_MODES[cli.gc],
        **({"model_init_kwargs": quantized_init_kwargs(cli)} if cli.load_in_4bit
           else {"model_init_kwargs": {"dtype": cli.dtype}} if cli.dtype else {}),
    )
    settings.update(json.loads(cli.config_json))  # TRL's options given as JSON override these defaults
    args = config_cls(**settings)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if cli.lora else None
    recorder = RecordCheckpointing()
    counter = CountSteps()
    gathers = GatherCount()
    callbacks = [recorder, counter, gathers]
    if cli.kill_at_step:
        callbacks.append(KillAtStep(cli.kill_at_step, cli.kill_rank))
    if cli.raise_at_step:
        callbacks.append(RaiseAtStep(cli.raise_at_step, cli.kill_rank))
    hold = HoldSave(*cli.hold_save) if cli.hold_save else None
    if hold is not None:
        callbacks.append(hold)
    if cli.slow_steps:
        callbacks.append(SlowSteps(cli.slow_steps))
    if cli.signal_at_step:
        callbacks.append(SignalAtStep(cli.signal_at_step, cli.signal_rank, getattr(signal, cli.signal)))
    if cli.signal_during_save:
        signal_during_save(cli.signal_during_save, cli.signal_rank, getattr(signal, cli.signal))
    trainer = trainer_cls(model=default_model_path(), args=args, train_dataset=dataset, eval_dataset=eval_dataset,
                          peft_config=peft_config, callbacks=callbacks)
    if cli.record_loading:
        os.makedirs(cli.output_dir, exist_ok=True)
        with open(os.path.join(cli.output_dir, f"weight_reads_rank{args.process_index}.json"), "w") as f:
            json.dump(dict(weight_reads.READS), f)
    if cli.kill_during_upload:
        peers = [os.getpid()]
        if torch.distributed.is_initialized():
            peers = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(peers, os.getpid())
        kill_during_upload(cli.kill_during_upload, peers)
    if cli.kill_during_save or cli.kill_during_states_save:
        peers = [os.getpid()]
        if torch.distributed.is_initialized():
            peers = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(peers, os.getpid())
        kill_every_rank_during_save(cli.kill_during_save or cli.kill_during_states_save, peers,
                                    states=bool(cli.kill_during_states_save))
    report = {"world_size": args.world_size, "zero_stage": None, "partition": None,
              "distributed_type": trainer.accelerator.distributed_type.value}
    if args.deepspeed_plugin is not None:
        report["zero_stage"] = args.deepspeed_plugin.zero_stage
    seen = record_samples(trainer)
    allocated_at_reserve = None
    if trainer.checkpoints.snapshot is not None:  # what the first step's reserve allocated for the copies
        reserve = trainer.checkpoints.reserve

        def reserving():
            nonlocal allocated_at_reserve
            reserve()
            allocated_at_reserve = trainer.checkpoints.snapshot.allocated

        trainer.checkpoints.reserve = reserving
    copy_order = None
    if cli.slow_copy or cli.unguarded_copy:
        copy_order = CopyOrder(trainer, cli.slow_copy or cli.unguarded_copy, guarded=bool(cli.slow_copy))
        trainer.add_callback(copy_order)
    with (step_peaks(trainer) if cli.tensor_peak else contextlib.nullcontext([]) as peaks,
          slow_uploads(cli.slow_uploads) if cli.slow_uploads else contextlib.nullcontext()):
        result = trainer.train(resume_from_checkpoint=cli.resume_from or (True if cli.resume else None))
    report["ddp_wrapped"] = isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    if trainer.is_deepspeed_enabled:
        report["partition"] = (recorder.seen or {}).get("partition") or partition_report(trainer.model_wrapped)
    if trainer.is_fsdp_enabled:  # FSDP2: parameters that are DTensors, those this rank holds only a part of, all
        params = list(trainer.model.parameters())
        dtensors = [p for p in params if isinstance(p, torch.distributed.tensor.DTensor)]
        report["fsdp_sharded"] = [len(dtensors), sum(p.to_local().numel() < p.numel() for p in dtensors), len(params)]
        report["fsdp_whole"] = [n for n, p in trainer.model.named_parameters()
                                if not isinstance(p, torch.distributed.tensor.DTensor)]
    report["losses"] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    report["train_loss"] = result.training_loss
    report["global_step"] = trainer.state.global_step
    report["log_history"] = trainer.state.log_history
    report["steps_run_here"] = counter.steps
    report["step_ends"] = counter.ends
    report["gathered"] = {"per_step": gathers.per_step, "model": model_numel(trainer.model)}
    report["tensor_peak_per_step"] = peaks
    with open(os.path.join(cli.output_dir, f"seen_rank{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump(seen, f)
    zero2 = trainer.is_deepspeed_enabled and args.deepspeed_plugin.zero_stage < 3
    if (cli.save_steps or cli.resume or cli.resume_from) and not zero2:  # ZeRO-2 links no optimizer states to its
        full = (full_optimizer_state(trainer.model_wrapped) if trainer.is_deepspeed_enabled  # parameters on CPU
                else full_optimizer_state(trainer.model, trainer.optimizer))  # (collective)
        if trainer.accelerator.is_main_process:
            save_file(full, os.path.join(cli.output_dir, "optimizer_full.safetensors"))
    resumes = cli.save_steps or cli.resume or cli.resume_from
    if resumes:  # what a resume must restore: the schedule and each rank's optimizer state
        scheduler = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)  # under accelerate's wrapper
        report["scheduler"] = {"last_epoch": scheduler.last_epoch, "last_lr": scheduler.get_last_lr()}
        optim = optimizer_state(trainer.optimizer)
        report["optimizer_steps"] = sorted({v.item() for k, v in optim.items() if k.endswith(".step")})
        report["optimizer_groups"] = [{k: v for k, v in group.items() if k in ("weight_decay", "betas", "eps", "lr")}
                                      for group in innermost_optimizer(trainer.optimizer).param_groups]
        rank = trainer.accelerator.process_index
        save_file(optim, os.path.join(cli.output_dir, f"optimizer_rank{rank}.safetensors"))
    report["checkpointing"] = recorder.seen
    checkpoints = trainer.checkpoints
    if checkpoints.executor is not None:  # background saves: when each started and finished, and the CPU copies
        own = [p.ds_tensor if hasattr(p, "ds_tensor") else p.to_local() if hasattr(p, "to_local") else p
               for p in trainer.model.parameters() if p.requires_grad or not cli.lora]
        last = checkpoints.last
        with open(os.path.join(cli.output_dir, f"saves_rank{args.process_index}.json"), "w") as f:
            json.dump({"events": checkpoints.executor.events, "held": hold.events if hold is not None else [],
                       "weight_bytes": last.weight_bytes if last is not None else 0,
                       "own_bytes": sum(t.nbytes for t in own), "allocated": checkpoints.snapshot.allocated,
                       "allocated_at_reserve": allocated_at_reserve, "measured": checkpoints.measured,
                       "costs": [cost.metrics() for cost in checkpoints.history],
                       "copy_order": copy_order.events if copy_order is not None else []}, f)
    if cli.load_in_4bit:
        report["quantization"] = quantization_report(trainer.model)
    if cli.save_model:
        probes = probe_outputs(trainer.model)  # collective under ZeRO-3: every rank runs it
        trainer.save_model(os.path.join(cli.output_dir, cli.save_model))
        if trainer.accelerator.is_main_process:
            with open(os.path.join(cli.output_dir, f"probes_{cli.save_model}.json"), "w") as f:
                json.dump(probes, f)
    weights = gathered_trainable(trainer.model)
    if cli.record_loading and getattr(trainer, "ref_model", None) is not None:  # FSDP2: collective per tensor
        ref = {n: p.full_tensor().detach().clone().contiguous() for n, p in trainer.ref_model.state_dict().items()}
        if trainer.accelerator.is_main_process:
            save_file(ref, os.path.join(cli.output_dir, "ref.safetensors"))
    if trainer.accelerator.is_main_process:
        save_file(weights, os.path.join(cli.output_dir, "trained.safetensors"))
    if trainer.mirror is not None and not cli.kill_during_upload:  # what the process's exit would wait for (the
        trainer.mirror.wait()  # next run of a shared launch must not start while this one's uploads go on)
    if trainer.accelerator.is_main_process:
        with open(os.path.join(cli.output_dir, f"report_rank{trainer.accelerator.process_index}.json"), "w") as f:
            json.dump(report, f)
    torch.distributed.barrier() if torch.distributed.is_initialized() else None


if __name__ == "__main__":
    launched.freeze_imports()  # see launched.py
    main()
    launched.finish()  # see launched.py
