"""SFT with trl_ext: TRL's SFT script, with ZeRO-3-safe saving and CPU fallbacks.

The tiny config trains the embedded model on the bundled arithmetic conversations, loss on the assistant's tokens
only (offline, CPU, about a minute):

```bash
python recipes/sft.py --config recipes/configs/sft.yaml
python recipes/sft.py --config recipes/configs/sft.yaml --use_peft --lora_r 8 --output_dir outputs/my-sft
```

Under DeepSpeed ZeRO-3 (2 CPU processes without a GPU, one per GPU with them). All three lines do the same:

```bash
python recipes/sft.py --config accelerate_configs/zero3.yaml   # no launcher warnings around it
accelerate launch recipes/sft.py --config accelerate_configs/zero3.yaml
accelerate launch --config_file accelerate_configs/zero3.yaml recipes/sft.py --config recipes/configs/sft.yaml
```

A real model (GPU), LoRA, TensorBoard logs in the output dir:

```bash
accelerate launch recipes/sft.py --config accelerate_configs/zero3.yaml --config recipes/configs/sft_qwen2.5_0.5b.yaml
```

Continue a stopped run: add `--output_dir <its dir> --resume_from_checkpoint true` (its last complete checkpoint).
"""


from trl_ext.launching.launch import launch_if_asked

launch_if_asked()  # under an accelerate config or a multi-machine job: start the processes before torch and TRL load

from trl_ext import (
    ModelConfig,
    ScriptArguments,
    SFTConfig,
    SFTTrainer,
    TrlParser,
    get_peft_config,
    get_quantization_config,
)
from trl_ext.assets import load_dataset_by_name, resolve_model
from trl_ext.data.vision import freeze_vision_tower
from trl_ext.launching.scripting import announce_done, parse_recipe_args, report_eval
from trl_ext.process import notice


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

    # Data
    dataset = load_dataset_by_name(script_args.dataset_name, script_args.dataset_config)

    # Train
    trainer = SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        peft_config=get_peft_config(model_args),
    )
    # A vision-language model (processor, image rows) trains its language model: the vision tower stays frozen
    if frozen := freeze_vision_tower(trainer.model):
        notice(f"vision-language model: its vision tower ({frozen} tensors) is frozen; the language model trains.")
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    # Save (gathered, verified, committed atomically) and evaluate on the held-out split
    trainer.save_model(training_args.output_dir)
    if trainer.eval_dataset is not None:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        report_eval(trainer, metrics, ["eval_loss", "eval_mean_token_accuracy"])
    announce_done(trainer, "SFT model")


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig))
    main(*parse_recipe_args(parser, "sft", dataset_kind="sft"))
