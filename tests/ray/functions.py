"""Functions that tests give to ``trl_ext.ray.fit``: Ray's workers import them from here (a small module, so that a
worker imports only what the function needs)."""


def train_sft(output_dir: str, steps: int) -> int:
    """A few SFT steps on the embedded tiny model, a checkpoint at the last one; returns the step reached."""
    from trl_ext import SFTConfig, SFTTrainer
    from trl_ext.assets import load_dataset_by_name, resolve_model

    dataset = load_dataset_by_name("trl-ext/arithmetic-sft")["train"].select(range(64))
    args = SFTConfig(output_dir=output_dir, max_steps=steps, save_steps=steps, save_strategy="steps",
                     per_device_train_batch_size=4, logging_steps=1, report_to="none", seed=42)
    trainer = SFTTrainer(model=resolve_model("trl-ext/tiny-llama"), args=args, train_dataset=dataset)
    trainer.train()
    return trainer.state.global_step


def raise_after_a_collective(output_dir: str) -> None:
    """Every rank meets the others in a collective; then rank 0 raises, a bug, while the others wait in the next."""
    import os

    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))
    if os.environ["RANK"] == "0":
        raise ValueError("a bug in rank 0")
    dist.all_reduce(torch.ones(1))
