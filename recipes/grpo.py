"""GRPO with trl_ext: TRL's GRPO, with ZeRO-3-safe saving, exact resume, CPU fallbacks, and a vLLM weight sync that
gathers one module at a time and sends the checkpoint's own names (see docs/grpo.md).

The tiny config trains the SFT-warmed embedded model on the bundled single-digit sums with a verifiable reward (the
right sum, plus a smaller reward for answering with a bare number), generating with transformers on CPU (~5 minutes),
and prints held-out accuracy before and after, sampled as in training and greedy:

```bash
python recipes/grpo.py --config recipes/configs/grpo.yaml
python recipes/grpo.py --config recipes/configs/grpo.yaml --max_steps 20 --output_dir outputs/my-grpo
```

Under DeepSpeed ZeRO-3 (2 CPU processes without a GPU, one per GPU with them):

```bash
python recipes/grpo.py --config accelerate_configs/zero3.yaml   # no launcher warnings around it
accelerate launch recipes/grpo.py --config accelerate_configs/zero3.yaml
```

Generation in a colocated vLLM on CPU (vLLM's CPU build, installed as docs/grpo.md says; the embedded head_dim-64
model, random weights: it shows the loop and every weight sync checked, not learning):

```bash
python recipes/grpo.py --config recipes/configs/grpo.yaml --model_name_or_path trl-ext/tiny-llama-vllm \
    --use_vllm true --vllm_mode colocate --max_steps 3
```

A real model on one GPU, LoRA, generation in a colocated vLLM (needs `pip install trl[vllm]`):

```bash
python recipes/grpo.py --config recipes/configs/grpo_qwen2.5_0.5b.yaml
```

Continue a stopped run: add `--output_dir <its dir> --resume_from_checkpoint true` (its last complete checkpoint).
"""

from trl_ext.launching.launch import launch_if_asked

launch_if_asked()  # under an accelerate config or a multi-machine job: start the processes before torch and TRL load

import re

import torch

from trl_ext import (
    GRPOConfig,
    GRPOTrainer,
    ModelConfig,
    ScriptArguments,
    TrlParser,
    get_peft_config,
    get_quantization_config,
)
from trl_ext.assets import load_dataset_by_name, resolve_model
from trl_ext.launching.scripting import announce_done, parse_recipe_args
from trl_ext.saving.gather import gathered

NUMBER = re.compile(r"-?\d+")
HELD_OUT_SAMPLES = 16  # completions sampled per held-out prompt


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion  # conversational or plain


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    """1 when the first number in the completion is the right answer, else 0 (verifiable: no reward model)."""
    return [1.0 if (m := NUMBER.search(_text(c))) and m.group() == str(a).strip() else 0.0
            for c, a in zip(completions, answer, strict=True)]


def format_reward(completions, **kwargs) -> list[float]:
    """0.5 when the completion is a bare number (the format the task asks for), else 0."""
    return [0.5 if NUMBER.fullmatch(_text(c).strip()) else 0.0 for c in completions]


def held_out_accuracy(trainer, rows, samples: int = 8, seed: int = 0) -> tuple[float, float]:
    """Accuracy on held-out prompts, greedy and sampled as in training.

    GRPO sharpens the sampling distribution it trains on, so the sampled accuracy (the share of right answers among
    `samples` completions per prompt, at the training temperature and sampling settings) is the measure of what it
    optimises; greedy accuracy moves only once the right answer becomes the most likely one. Every rank runs the same
    prompts (under ZeRO-3 generation is collective).

    Args:
        trainer: The GRPO trainer whose model, tokenizer and sampling settings are used.
        rows: Held-out rows with `prompt` (conversational) and `answer`.
        samples: Completions sampled per prompt.
        seed: Seed of the sampling, in a forked RNG, so before and after draw alike and training's RNG is untouched.

    Returns:
        `(greedy, sampled)` accuracies in [0, 1].
    """
    tokenizer, model = trainer.processing_class, trainer.model
    prompts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    common = {"max_new_tokens": trainer.max_completion_length, "pad_token_id": tokenizer.pad_token_id,
              "synced_gpus": trainer.is_deepspeed_enabled}
    sampling = {"do_sample": True, "num_return_sequences": samples, "temperature": trainer.temperature,
                "top_p": trainer.top_p, "top_k": trainer.top_k, "min_p": trainer.min_p,
                "repetition_penalty": trainer.repetition_penalty}
    was_training = model.training
    model.eval()
    # Gathered whole for the few generation calls: before training no DeepSpeed engine exists to fetch partitions.
    with torch.no_grad(), gathered(list(model.parameters())), torch.random.fork_rng():
        torch.manual_seed(seed)
        greedy = model.generate(**batch, do_sample=False, **common)
        sampled = model.generate(**batch, **sampling, **common)
    model.train(was_training)

    def accuracy(out, answers):
        texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        return sum(correctness_reward(texts, answers)) / len(texts)

    return accuracy(greedy, rows["answer"]), accuracy(sampled, [a for a in rows["answer"] for _ in range(samples)])


def main(script_args, training_args, model_args):
    # Model: the embedded tiny model unless the config names another; 4-bit/8-bit loading from the QLoRA flags.
    model = resolve_model(model_args.model_name_or_path)
    training_args.model_init_kwargs = {
        "dtype": model_args.dtype,
        "revision": model_args.model_revision,
        "attn_implementation": model_args.attn_implementation,
        "quantization_config": get_quantization_config(model_args),
        **(training_args.model_init_kwargs or {}),
    }

    # Data: prompts and the answers the reward checks
    dataset = load_dataset_by_name(script_args.dataset_name, script_args.dataset_config)

    # Train
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[correctness_reward, format_reward],
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        peft_config=get_peft_config(model_args),
    )
    held_out = dataset[script_args.dataset_test_split]
    before = held_out_accuracy(trainer, held_out, HELD_OUT_SAMPLES)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    # Save (gathered, verified, committed atomically) and evaluate on held-out prompts
    trainer.save_model(training_args.output_dir)
    after = held_out_accuracy(trainer, held_out, HELD_OUT_SAMPLES)
    if trainer.accelerator.is_main_process:
        sampled = f"sampled at temperature {trainer.temperature:g}, {HELD_OUT_SAMPLES} per prompt"
        for i, kind in ((1, sampled), (0, "greedy")):  # sampled first: what GRPO optimises (held_out_accuracy)
            print(f"[trl_ext] held-out accuracy ({kind}), before -> after training: {before[i]:.3f} -> {after[i]:.3f} "
                  f"({len(held_out)} prompts)", flush=True)
    announce_done(trainer, "GRPO model")


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    main(*parse_recipe_args(parser, "grpo", dataset_kind=None))
