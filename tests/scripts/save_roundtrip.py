"""Train briefly, record the model's outputs on fixed probe inputs at every save, and save the ways users do.

Run under ``accelerate launch`` (see ``tests/harness.py``). Writes, on rank 0:
- ``probes/<name>.json``: the trained model's outputs (logits, or rewards) when ``<name>`` was saved;
- ``report.json``: the outcome of each user-facing save call.
The checkpoints are then reloaded in a fresh process by ``reload.py`` (plain transformers + peft).
"""

import argparse
import contextlib
import json
import os
import re
import signal
from pathlib import Path

import launched  # tests/scripts/, beside this file
import torch
from peft import LoraConfig, TaskType
from transformers import TrainerCallback

import trl_ext
from trl_ext.assets import default_model_path, load_default_dataset
from trl_ext.engines import sharded
from trl_ext.files import shards
from trl_ext.process.ranks import env_rank
from trl_ext.saving import gather
from trl_ext.saving.trainer_files import PartialDir

TRAINERS = {
    "sft": (trl_ext.SFTTrainer, trl_ext.SFTConfig, "sft"),
    "reward": (trl_ext.RewardTrainer, trl_ext.RewardConfig, "reward"),
    "dpo": (trl_ext.DPOTrainer, trl_ext.DPOConfig, "preference"),
}
PROBE_IDS = [[10 + i for i in range(12)], [40 + 3 * i for i in range(12)]]


def probe_outputs(model, trainer_kind: str) -> list:
    """Logits (causal LM) or rewards (reward model) on the probe inputs; collective under ZeRO-3 (all ranks call)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        ids = torch.tensor(PROBE_IDS, device=next(model.parameters()).device)
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().cpu()
    model.train(was_training)
    return out.tolist()


class RecordProbes(TrainerCallback):
    def __init__(self, out: Path, kind: str):
        self.out, self.kind = out, kind

    def on_save(self, args, state, control, model=None, **kwargs):
        record(self.out, f"checkpoint-{state.global_step}", probe_outputs(model, self.kind))


def record(out: Path, name: str, outputs) -> None:
    if env_rank() == 0:
        (out / "probes").mkdir(parents=True, exist_ok=True)
        (out / "probes" / f"{name}.json").write_text(json.dumps(outputs))


def head_stats(model) -> dict:
    """The trainable reward head's weight as initialised (gathered from its ZeRO-3 partitions on every rank)."""
    name, param = next((n, p) for n, p in model.named_parameters() if "score" in n and p.requires_grad)
    ctx = contextlib.nullcontext()
    if hasattr(param, "ds_id"):
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters([param], modifier_rank=None)
    with ctx:
        weight = param.detach().float().clone()
    return {"name": name, "shape": list(weight.shape), "std": weight.std().item(), "mean": weight.mean().item(),
            "zeros": int((weight == 0).sum()), "finite": bool(torch.isfinite(weight).all()),
            "partitioned": hasattr(param, "ds_id")}


def kill_during_save(save_number: int) -> None:
    """Simulate a crash: rank 0 SIGKILLs itself after writing the first tensor of the N-th checkpoint save."""
    saves = {"count": 0}
    create, end = PartialDir.create, shards.ShardStreamWriter.end

    def counting_create(self):
        saves["count"] += 1
        return create(self)

    def write_then_die(self):
        end(self)
        if saves["count"] == save_number and env_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    PartialDir.create = counting_create
    shards.ShardStreamWriter.end = write_then_die


WRITES: dict = {}  # the run in progress: {"out": its output directory, save: bytes}


def record_writes(out: Path) -> None:
    """Count the bytes this rank writes into each save's weight files, in ``writes_rank{R}.json``: {save: bytes}.
    (Patched once per process: ``run_many.py`` runs several trainings in one.)"""
    WRITES.clear()
    WRITES["out"] = out
    if getattr(shards.ShardStreamWriter.end, "counts_writes", False):
        return
    end = shards.ShardStreamWriter.end

    def counting_end(self):
        spec = self._queue[self._position][1]
        end(self)
        if "out" in WRITES:
            save = re.search(r"(checkpoint-\d+|final)", str(self.directory)).group(1)
            WRITES[save] = WRITES.get(save, 0) + spec.nbytes
            counts = {k: v for k, v in WRITES.items() if k != "out"}
            (WRITES["out"] / f"writes_rank{env_rank()}.json").write_text(json.dumps(counts))

    counting_end.counts_writes = True
    shards.ShardStreamWriter.end = counting_end


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=TRAINERS, required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--lora_all_linear", action="store_true",
                        help="the report-F2 config: LoraConfig(target_modules='all-linear'), no task_type")
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--save_steps", type=int, default=0)
    parser.add_argument("--max_shard_size", default="50GB")
    parser.add_argument("--kill_during_save", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--iter_merged", action="store_true",
                        help="also write trl_ext.merge.iter_merged_weights (all ranks iterate) to "
                        "iter_merged.safetensors")
    parser.add_argument("--gather_whole", action="store_true", help="use the GatheredParameters path for every param")
    parser.add_argument("--record_writes", action="store_true", help="each rank's bytes written per save")
    parser.add_argument("--save_in_background", action="store_true", help="checkpoints written in the background")
    cli = parser.parse_args(argv)
    out = Path(cli.output_dir)
    WRITES.clear()
    if cli.record_writes:
        out.mkdir(parents=True, exist_ok=True)
        record_writes(out)
    if cli.gather_whole:  # the path taken for NVMe-offloaded or quantized partitions, or several writers
        gather.streamable = lambda param, world: False
    if cli.kill_during_save:
        kill_during_save(cli.kill_during_save)

    trainer_cls, config_cls, data_kind = TRAINERS[cli.trainer]
    args = config_cls(
        output_dir=str(out), max_steps=cli.max_steps, per_device_train_batch_size=2, learning_rate=1e-2,
        logging_steps=1, report_to="none", seed=0, dataloader_num_workers=0, gradient_checkpointing=False,
        save_strategy="steps" if cli.save_steps else "no", save_steps=cli.save_steps or 500,
        max_shard_size=cli.max_shard_size, save_in_background=cli.save_in_background,
    )
    peft_config = None
    if cli.lora:
        task = TaskType.SEQ_CLS if cli.trainer == "reward" else TaskType.CAUSAL_LM
        peft_config = LoraConfig(task_type=task, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    if cli.lora_all_linear:
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    dataset = load_default_dataset(data_kind)["train"].select(range(32))
    trainer = trainer_cls(model=default_model_path(), args=args, train_dataset=dataset, peft_config=peft_config,
                          callbacks=[RecordProbes(out, cli.trainer)])
    report = {"zero_stage": args.deepspeed_plugin.zero_stage if args.deepspeed_plugin else None,
              "head_at_init": head_stats(trainer.model) if cli.trainer == "reward" else None}
    trainer.train(resume_from_checkpoint=cli.resume or None)

    report["partitioned"] = sharded.has_partitioned_params(trainer.model)
    record(out, "final", probe_outputs(trainer.model, cli.trainer))
    trainer.save_model(str(out / "final"))
    report["partitioned"] = sharded.has_partitioned_params(trainer.model)  # the probe forward may gather
    if report["zero_stage"] == 3:
        try:  # what many users' scripts and notebooks do after training
            trainer.model.save_pretrained(str(out / "user_save_pretrained"),
                                          is_main_process=trainer.accelerator.is_main_process)
            report["user_save_pretrained"] = "saved"
        except RuntimeError as exc:
            report["user_save_pretrained"] = str(exc)
    if cli.iter_merged:
        from safetensors.torch import save_file

        from trl_ext.merge.weights import iter_merged_weights

        merged = dict(iter_merged_weights(trainer.model))
        report["adapter_still_unmerged"] = not any(getattr(m, "merged", False) for m in trainer.model.modules())
        if trainer.accelerator.is_main_process:
            save_file({n: t.contiguous() for n, t in merged.items()}, str(out / "iter_merged.safetensors"))
    if trainer.accelerator.is_main_process:
        (out / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    launched.freeze_imports()  # see launched.py
    main()
    launched.finish()  # see launched.py
