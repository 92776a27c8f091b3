"""Train trl_ext's GRPOTrainer or RLOOTrainer with a real, colocated vLLM (``use_vllm=True, vllm_mode="colocate"``) on
``trl-ext/tiny-llama-vllm``; record what happened in OUTPUT_DIR/report_rank<R>.json. One process, or under
``accelerate launch`` (tests/vllm/). Needs vLLM (the vLLM venv, .ci/vllm.sh).

After training: the model is saved to OUTPUT_DIR/final, the weights are synced once more (checked), and vLLM's prompt
log-probabilities of the check's tokens are written to the report, for the test to compare with the saved model's
in a fresh process.

``--fault``: at the second sync, ``sent-stale`` sends ``lm_head.weight`` as it was at the first sync (a broken walk);
``not-applied`` streams the weights without loading them (vLLM keeps its old ones, as trl#5312's sleep mode did).
The run must then stop with a SyncError; the report records it.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import launched  # tests/scripts/, beside this file
import torch
import transformers
from peft import LoraConfig

import trl_ext
from trl_ext.assets import load_default_dataset, vllm_model_path
from trl_ext.errors import SyncError
from trl_ext.trainers.sync_check import engine_logprobs

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository's tests package


def digit_share(completions, **kwargs) -> list[float]:
    """A dense reward (share of digits in the completion): samples differ in it from the first step."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def install_fault(generation, fault: str, at: int = 2) -> None:
    """Break a sync of ``generation``: ``sent-stale`` the second, ``not-applied`` the ``at``-th of this process (see
    the module docstring)."""
    walks, syncs, first = [0], [0], {}
    walk, rpc = generation._iter_named_params, generation.llm.collective_rpc

    def stale_walk():  # walk 1 is the first sync; walk 2 the second (stale); walk 3 the failed check's naming pass
        walks[0] += 1
        for name, tensor in walk():
            if name == "lm_head.weight" and walks[0] == 1:
                first[name] = tensor.clone()
            elif name == "lm_head.weight" and walks[0] == 2:
                tensor = first[name]
            yield name, tensor

    def dropping_rpc(method, *args, **kwargs):
        syncs[0] += method == "reload_weights"
        if syncs[0] == at and method == "reload_weights":
            for _ in kwargs["kwargs"]["weights_iterator"]:  # gathered and walked, never loaded
                pass
            return [None]
        return rpc(method, *args, **kwargs)

    if fault == "sent-stale":
        generation._iter_named_params = stale_walk
    else:
        generation.llm.collective_rpc = dropping_rpc


def model_path(family: str | None) -> str:
    if family is None:
        return vllm_model_path()
    from tests.families import vllm_family_path

    return vllm_family_path(family)


def peft_config(adapter: str, family: str | None):
    """``lora``: LoRA on the attention's projections (Phi-3's fused one) and the head trained whole where it is not
    tied; ``lora-embed``: LoRA plus the input embeddings (and an untied head) trained whole, through modules_to_save."""
    if adapter == "full":
        return None
    from transformers import AutoConfig

    tied = AutoConfig.from_pretrained(model_path(family)).tie_word_embeddings
    targets = ["qkv_proj"] if family == "phi3" else ["q_proj", "v_proj"]
    whole = ([] if tied else ["lm_head"]) + (["embed_tokens"] if adapter == "lora-embed" else [])
    # a tied pair trains as one matrix (ensure_weight_tying): vllm_checks refuses an adapter that unties it
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, modules_to_save=whole or None,
                      ensure_weight_tying=tied)


def run(cli, family: str | None, adapter: str, output_dir: str, trainer_name: str, fault: str | None = None,
        fault_at: int = 2) -> None:
    """Train one case with its own colocated vLLM; write OUTPUT_DIR/report_rank<R>.json (see the module docstring)."""
    transformers.set_seed(0)
    config_class = trl_ext.GRPOConfig if trainer_name == "grpo" else trl_ext.RLOOConfig
    trainer_class = trl_ext.GRPOTrainer if trainer_name == "grpo" else trl_ext.RLOOTrainer
    args = config_class(
        output_dir=output_dir, max_steps=cli.max_steps, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, learning_rate=1e-2, logging_steps=1, report_to="none", seed=0,
        save_strategy="steps" if cli.save_steps else "no", save_steps=cli.save_steps or 500,
        dataloader_num_workers=0, use_vllm=True, vllm_mode="colocate", vllm_check_sync_every=cli.check_every,
    )
    trainer = trainer_class(
        model=model_path(family), reward_funcs=digit_share, args=args,
        train_dataset=load_default_dataset("prompt")["train"].select(range(64)),
        peft_config=peft_config(adapter, family),
    )
    generation = trainer.vllm_generation
    if fault:
        install_fault(generation, fault, fault_at)
    rank = trainer.accelerator.process_index
    report = {"world_size": args.world_size, "fault": fault, "family": family, "adapter": adapter,
              "trainer": trainer_name, "engine_dtype": str(generation.llm.llm_engine.model_config.dtype),
              "zero_stage": args.deepspeed_plugin.zero_stage if args.deepspeed_plugin else None,
              "resumed_from": cli.resume_from}
    try:
        trainer.train(resume_from_checkpoint=cli.resume_from)
    except SyncError as exc:
        report.update(error=str(exc), kind=exc.kind, detail=exc.detail, global_step=trainer.state.global_step)
    else:
        trainer.save_model(os.path.join(output_dir, "final"))
        generation.sync_check.every = 1  # the sync after training is checked, whatever the run's setting
        generation.sync_weights()
        report.update(global_step=trainer.state.global_step,
                      engine_logprobs=engine_logprobs(generation.llm, generation.sync_check.tokens).tolist(),
                      tokens=generation.sync_check.tokens, losses=[h["loss"] for h in trainer.state.log_history
                                                                    if "loss" in h])
    report.update(syncs=generation.sync_check.syncs, sync_seconds=generation.sync_seconds,
                  check_seconds=generation.sync_check.seconds,
                  checked={h["step"]: h["sync/checked"] for h in trainer.state.log_history if "sync/checked" in h})
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, f"report_rank{rank}.json"), "w") as f:
        json.dump(report, f)
    torch.distributed.barrier() if torch.distributed.is_initialized() else None
    if args.world_size == 1:  # vLLM's shutdown destroys the process group, which a launch cannot build again
        generation._shut_down_colocated()  # the next case starts an engine of its own in this process


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--trainer", choices=["grpo", "rloo"], default="grpo")
    parser.add_argument("--lora", action="store_true", help="the same as --case :lora")
    parser.add_argument("--case", action="append", default=[],
                        help="FAMILY:ADAPTER[:TRAINER[:FAULT@SYNC]], repeatable: a tests.families.VLLM_FAMILIES name "
                        "(empty: the embedded trl-ext/tiny-llama-vllm), full, lora or lora-embed, grpo or rloo "
                        "(default --trainer), a fault at this process's SYNC-th sync; each case writes OUTPUT_DIR/"
                        "FAMILY-ADAPTER-TRAINER[-FAULT]/. Without --case, one run writes OUTPUT_DIR itself")
    parser.add_argument("--max_steps", type=int, default=3)
    parser.add_argument("--check_every", type=int, default=1)
    parser.add_argument("--save_steps", type=int, default=0, help="save a checkpoint every N steps (default: none)")
    parser.add_argument("--resume_from", default=None, help="a checkpoint directory to resume every case from")
    parser.add_argument("--fault", choices=["sent-stale", "not-applied"], default=None)
    cli = parser.parse_args(argv)
    if not cli.case:
        return run(cli, None, "lora" if cli.lora else "full", cli.output_dir, cli.trainer, cli.fault)
    for case in cli.case:
        family, adapter, trainer_name, fault = (case.split(":") + [cli.trainer, ""][len(case.split(":")) - 2:])[:4]
        fault, _, at = fault.partition("@")
        name = "-".join(filter(None, [family or "default", adapter, trainer_name, fault]))
        run(cli, family or None, adapter, os.path.join(cli.output_dir, name), trainer_name, fault or None,
            int(at or 2))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    launched.freeze_imports()  # see launched.py
    main()
    launched.finish()  # see launched.py
