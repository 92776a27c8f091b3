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


def lose_a_worker(output_dir: str, commit_on: list) -> None:
    """Each worker group (an attempt) meets, commits ``checkpoint-<attempt>`` when its attempt is in ``commit_on``, and
    then loses rank 1's worker (its process ends as a lost machine's would), while rank 0 waits in a collective."""
    import os
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from trl_ext.placement import ownership

    attempt = int(ownership.record(output_dir).get("groups", 0))
    dist.all_reduce(torch.ones(1))
    if os.environ["RANK"] == "0" and attempt in commit_on:
        (Path(output_dir) / f"checkpoint-{attempt}").mkdir()
    dist.barrier()
    if os.environ["RANK"] == "1":
        os._exit(1)
    dist.all_reduce(torch.ones(1))
