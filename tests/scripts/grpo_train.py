"""Train trl_ext.GRPOTrainer (LoRA, transformers generation) on the embedded model and arithmetic prompts; record
what happened in OUTPUT_DIR/report_rank0.json. Single process, or under ``accelerate launch`` (tests/harness.py).

With ``--vllm_server URL``: generation and the weight sync go to that server (vLLM's server mode; see
tests/vllm_server_standin.py), each wait bounded by ``--request_timeout`` seconds.

Several runs in one launch: ``run_many.py grpo_train.py ARGS_JSON``.

With ``--save_model NAME``: the trained adapter is saved to OUTPUT_DIR/NAME, the policy's probe outputs to
probes_NAME.json, and the weights the vLLM sync would send (every rank walks, rank 0 keeps them) to synced.safetensors.
"""

import argparse
import json
import os

import launched  # tests/scripts/, beside this file
import torch
import transformers
from peft import LoraConfig
from safetensors.torch import save_file
from train import CountSteps, KillAtStep, gathered_trainable, partition_report, probe_outputs

import trl_ext
from trl_ext.assets import default_model_path, load_default_dataset
from trl_ext.engines.sharded import is_dtensor
from trl_ext.trainers.weight_sync import BoundedVLLMGeneration, bounded_named_params


def digit_share(completions, **kwargs) -> list[float]:
    """A dense reward (share of digits in the completion): a random model's samples differ in it, so the
    group-relative advantages are non-zero from the first step."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=3)
    parser.add_argument("--save_steps", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill_at_step", type=int, default=0)
    parser.add_argument("--save_model", default=None)
    parser.add_argument("--vllm_server", default=None)
    parser.add_argument("--request_timeout", type=float, default=600.0)
    cli = parser.parse_args(argv)
    transformers.set_seed(0)  # the LoRA weights are drawn before Trainer seeds: the same in a run after another
    server = {}
    if cli.vllm_server:
        import vllm_nccl_standin

        vllm_nccl_standin.install()
        server = {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": cli.vllm_server,
                  "vllm_server_timeout": 30, "vllm_request_timeout": cli.request_timeout}

    args = trl_ext.GRPOConfig(
        output_dir=cli.output_dir, max_steps=cli.max_steps, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, learning_rate=5e-3, logging_steps=1, report_to="none", seed=0,
        save_strategy="steps" if cli.save_steps else "no", save_steps=cli.save_steps or 500,
        gradient_checkpointing=True, dataloader_num_workers=0, **server,
    )
    callbacks = [CountSteps()] + ([KillAtStep(cli.kill_at_step, None)] if cli.kill_at_step else [])
    trainer = trl_ext.GRPOTrainer(
        model=default_model_path(), reward_funcs=digit_share, args=args,
        train_dataset=load_default_dataset("prompt")["train"].select(range(64)),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
        callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint=True if cli.resume else None)
    report = {"world_size": args.world_size, "global_step": trainer.state.global_step,
              "steps_run_here": callbacks[0].steps, "log_history": trainer.state.log_history,
              "zero_stage": args.deepspeed_plugin.zero_stage if args.deepspeed_plugin else None,
              "partition": partition_report(trainer.model_wrapped) if trainer.is_deepspeed_enabled else None}
    if trainer.is_fsdp_enabled:  # FSDP2: every parameter a DTensor shard
        params = list(trainer.model.parameters())
        report["partition"] = {"num_params": len(params), "num_dtensors": sum(map(is_dtensor, params))}
    main_process = trainer.accelerator.is_main_process
    if cli.save_model:
        probes = probe_outputs(trainer.model)  # collective under ZeRO-3: every rank runs it
        trainer.save_model(os.path.join(cli.output_dir, cli.save_model))
        generation = BoundedVLLMGeneration.__new__(BoundedVLLMGeneration)  # the sync's walk, without an engine
        generation.model, generation.accelerator = trainer.model, trainer.accelerator
        synced = dict(bounded_named_params(generation))
        if main_process:
            save_file({k: v.contiguous() for k, v in synced.items()},
                      os.path.join(cli.output_dir, "synced.safetensors"))
            with open(os.path.join(cli.output_dir, f"probes_{cli.save_model}.json"), "w") as f:
                json.dump(probes, f)
    weights = gathered_trainable(trainer.model)
    if main_process:
        save_file(weights, os.path.join(cli.output_dir, "trained.safetensors"))
        with open(os.path.join(cli.output_dir, "report_rank0.json"), "w") as f:
            json.dump(report, f)
    torch.distributed.barrier() if torch.distributed.is_initialized() else None


if __name__ == "__main__":
    launched.freeze_imports()  # see launched.py
    main()
    launched.finish()  # see launched.py
