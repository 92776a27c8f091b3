"""Train several model families in turn, in one set of processes, and record what the checks need.

Run under ``accelerate launch`` (2-process ZeRO-3 or FSDP2, see ``tests/harness.py``) or alone. For each run
``FAMILY:TRAINER:MODE`` (trainer sft|reward|dpo, mode lora|full|experts) it writes to ``OUT/FAMILY-TRAINER-MODE/``:
``final/`` (``trainer.save_model``), ``probes_loaded.json`` (outputs of the model as loaded, before any step),
``probes_final.json`` (after training), ``iter.safetensors`` (``iter_merged_weights``, from rank 0) and
``report.json`` (partitioning seen during training), for full models ``reference/`` (the metadata files the trained
model's own ``save_pretrained`` writes, from rank 0: ``state_dict={}`` writes no weights) and, with
``--resume_check``, for full fine-tuning ``probes_resumed.json`` (a new trainer resumed from ``checkpoint-1`` and ran
step 2 again). One process set for all runs: start-up costs more than a run.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a file or as tests.scripts.family_train (-m)
import launched  # noqa: E402 - tests/scripts/, beside this file
import torch  # noqa: E402
import transformers
from accelerate.state import AcceleratorState, GradientState
from peft import LoraConfig
from safetensors.torch import save_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

import trl_ext
from tests.families import FAMILIES, family_path
from trl_ext.assets import load_default_dataset
from trl_ext.engines.sharded import is_dtensor
from trl_ext.merge.weights import iter_merged_weights

PROBE_IDS = [[10 + i for i in range(12)], [40 + 3 * i for i in range(12)]]
TRAINERS = {"sft": (trl_ext.SFTTrainer, trl_ext.SFTConfig, "sft"),
            "reward": (trl_ext.RewardTrainer, trl_ext.RewardConfig, "reward"),
            "dpo": (trl_ext.DPOTrainer, trl_ext.DPOConfig, "preference")}


def probe(model) -> list:
    """Outputs on fixed ids, in eval mode; gathers a ZeRO-3 model first (collective: every rank calls it)."""
    import contextlib

    params = [p for p in model.parameters() if hasattr(p, "ds_id")]
    gathered = contextlib.nullcontext()
    if params:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params)
    was_training = model.training
    model.eval()
    with gathered, torch.no_grad():
        ids = torch.tensor(PROBE_IDS)
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().tolist()
    model.train(was_training)
    return out


class SeePartitioning(TrainerCallback):
    def __init__(self):
        self.seen = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.seen is None:
            params = list(model.parameters())
            self.seen = {"num_params": len(params),  # ZeRO-3 placeholders, or FSDP2's DTensor shards
                         "num_partitioned": sum((hasattr(p, "ds_id") and p.numel() == 0) or is_dtensor(p)
                                                for p in params)}


def load(family: str, trainer: str):
    """The family's model as the user loads it (after the training arguments, so ZeRO-3 builds it partitioned)."""
    path = family_path(family)
    if trainer == "reward":
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    return getattr(transformers, FAMILIES[family][2]).from_pretrained(path, dtype=torch.float32)


def run(family: str, trainer_name: str, mode: str, out: Path, resume_check: bool) -> None:
    trainer_cls, config_cls, data_kind = TRAINERS[trainer_name]
    args = config_cls(output_dir=str(out / "train"), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2,
                      logging_steps=1, save_strategy="steps" if resume_check else "no", save_steps=1,
                      report_to="none", seed=0, max_length=64)
    model = load(family, trainer_name)
    loaded = probe(model)
    tokenizer = AutoTokenizer.from_pretrained(family_path(family))
    lora = None
    if mode == "lora":
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"] if family != "phi3" else ["qkv_proj"])
    elif mode == "experts":  # LoRA on the fused MoE expert tensors too (PEFT's target_parameters)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                          target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    seen = SeePartitioning()
    data = load_default_dataset(data_kind)["train"].select(range(8))
    trainer = trainer_cls(model=model, args=args, train_dataset=data, processing_class=tokenizer, peft_config=lora,
                          callbacks=[seen])
    trainer.train()
    final = probe(trainer.model)
    resumed = None
    if resume_check:  # a new model and trainer resume from checkpoint-1, as after a crash, and run step 2 again
        reset_accelerate()
        again = trainer_cls(model=load(family, trainer_name), args=args, train_dataset=data,
                            processing_class=tokenizer, peft_config=lora)
        again.train(resume_from_checkpoint=str(out / "train" / "checkpoint-1"))
        resumed = probe(again.model)
        del again
    trainer.save_model(str(out / "final"))
    merged = dict(iter_merged_weights(trainer.model))  # every rank: gathers one module at a time
    if trainer.accelerator.is_main_process:
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        if not hasattr(unwrapped, "peft_config"):  # PEFT's save_pretrained needs the weights (adapters: family_check)
            unwrapped.save_pretrained(str(out / "reference"), state_dict={})  # no collective: no weights are read
            tokenizer.save_pretrained(str(out / "reference"))
        save_file({k: v.contiguous() for k, v in merged.items()}, str(out / "iter.safetensors"))
        for name, value in {"probes_loaded": loaded, "probes_final": final, "report": seen.seen,
                            "probes_resumed": resumed}.items():
            (out / f"{name}.json").write_text(json.dumps(value))
    trainer.accelerator.wait_for_everyone()
    del trainer, model, merged
    reset_accelerate()


def reset_accelerate() -> None:
    for cls in (AcceleratorState, GradientState):  # the next trainer builds its own accelerator
        cls._shared_state.clear()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", required=True, help="comma-separated FAMILY:TRAINER:MODE")
    parser.add_argument("--resume_check", action="store_true", help="full runs also resume from checkpoint-1")
    cli = parser.parse_args()
    for spec in cli.runs.split(","):
        family, trainer, mode = spec.split(":")
        out = Path(cli.out) / f"{family}-{trainer}-{mode}"
        out.mkdir(parents=True, exist_ok=True)
        run(family, trainer, mode, out, resume_check=cli.resume_check and mode == "full")


if __name__ == "__main__":
    launched.freeze_imports()  # see launched.py
    main()
    launched.finish()  # see launched.py
