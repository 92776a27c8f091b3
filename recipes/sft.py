"""SFT with trl_ext: TRL's SFT script, with ZeRO-3-safe saving and CPU fallbacks.

With no arguments it trains the embedded tiny model on the bundled arithmetic conversations (offline, CPU):

```bash
python recipes/sft.py --config recipes/configs/sft.yaml
```

A real model (GPU), LoRA:

```bash
accelerate launch recipes/sft.py \
    --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name trl-lib/Capybara \
    --learning_rate 2e-4 --per_device_train_batch_size 2 --gradient_accumulation_steps 8 \
    --use_peft --lora_r 32 --lora_alpha 16 --output_dir Qwen2.5-0.5B-SFT
```
"""

from trl import get_peft_config

from trl_ext import ModelConfig, ScriptArguments, SFTConfig, SFTTrainer, TrlParser
from trl_ext.assets import load_dataset_by_name, resolve_model
from trl_ext.scripting import announce_done, prepare_output_dir

DEFAULT_DATASET = "trl-ext/arithmetic-sft"  # bundled conversational "messages" rows


def main(script_args, training_args, model_args):
    # Setup: a fresh run directory unless one was chosen; never train over another run.
    prepare_output_dir(training_args, "sft")

    # Model and data: the embedded defaults unless the config names others.
    model = resolve_model(model_args.model_name_or_path)
    training_args.model_init_kwargs = {"dtype": model_args.dtype, **(training_args.model_init_kwargs or {})}
    dataset = load_dataset_by_name(script_args.dataset_name or DEFAULT_DATASET, script_args.dataset_config)

    # Train
    trainer = SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    # Save and evaluate
    trainer.save_model(training_args.output_dir)
    if trainer.eval_dataset is not None:
        trainer.log_metrics("eval", trainer.evaluate())
    announce_done(trainer, "SFT model", f"python recipes/dpo.py --config recipes/configs/dpo.yaml "
                  f"--model_name_or_path {training_args.output_dir}")


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig))
    main(*parser.parse_args_and_config())
