"""Build the embedded warmed model: ``trl-ext/tiny-llama`` after a short SFT pass on the bundled arithmetic data.

A randomly initialised model answers nothing, so preference and RL demos on it end on noise. This one answers
about half of the held-out sums, which leaves DPO/GRPO visible room to improve real answers. Built once on first
use (seconds on CPU) and cached like the base model.
"""

import os
import sys

from trl_ext.assets.cache import cached_build

ARITH_MODEL_NAME = "trl-ext/tiny-llama-arith"  # resolved to a local build, never fetched from the Hub
_BUILD_DIR_NAME = "tiny-llama-arith-v1"  # bump when the build (or the base model, or the data) changes
# A short run on purpose: ~300 steps leave it right on about half the held-out sums; ~500 steps answer nearly all,
# and then a DPO demo has nothing left to improve.
STEPS, BATCH_SIZE, LEARNING_RATE, WARMUP = 300, 64, 3e-3, 20


def arith_model_path() -> str:
    """Return the local path of the warmed model, building it (and the base model) on first use."""
    return cached_build(_BUILD_DIR_NAME, __name__)


def greedy_accuracy(model, tokenizer, prompts, answers, max_new_tokens: int = 4, batch_size: int = 64) -> float:
    """Share of prompts whose greedy completion (one process, no sampling) is exactly the reference answer.

    Args:
        model: A causal LM (or a PEFT model around one).
        tokenizer: Its tokenizer, with a chat template.
        prompts: Conversations that end before the answer (the ``prompt`` column of ``trl-ext/arithmetic-preference``).
        answers: The reference answers, one string each.
        max_new_tokens: Generation length; a sum and its end token take a few tokens.
        batch_size: Prompts per generation batch.

    Returns:
        The exact-match accuracy, between 0 and 1.
    """
    import torch

    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # generation continues after the prompt
    correct = 0
    try:
        for start in range(0, len(prompts), batch_size):
            texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
                     for p in prompts[start:start + batch_size]]
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            with torch.no_grad():
                out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
            completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
            correct += sum(c.strip() == a.strip() for c, a in zip(completions, answers[start:start + batch_size]))
    finally:
        tokenizer.padding_side = side
    return correct / len(prompts)


def _encode(tokenizer, rows):
    """Token ids, attention mask and labels (the answer and its end token only) as padded tensors."""
    import torch

    encoded = []
    for messages in rows:
        prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(messages[-1]["content"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        encoded.append((prompt_ids, answer_ids))
    length = max(len(p) + len(a) for p, a in encoded)
    ids = torch.full((len(rows), length), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), -100)
    for i, (prompt_ids, answer_ids) in enumerate(encoded):
        n, m = len(prompt_ids), len(answer_ids)
        ids[i, :n + m] = torch.tensor(prompt_ids + answer_ids)
        mask[i, :n + m] = 1
        labels[i, n:n + m] = torch.tensor(answer_ids)
    return ids, mask, labels


def build(path: str | os.PathLike) -> None:
    """SFT the embedded tiny Llama on ``trl-ext/arithmetic-sft`` (train split) and write it with its tokenizer.

    A plain torch loop, one thread, batches drawn by numpy's seeded generator: no dataloader workers or thread
    scheduling to vary, so machines with the same torch build get the same model (other CPU instruction sets may
    round differently, so bitwise equality everywhere is not promised).
    """
    import math

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_ext.assets.datasets import load_default_dataset
    from trl_ext.assets.tiny_model import default_model_path

    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    ids, mask, labels = _encode(tokenizer, load_default_dataset("sft")["train"]["messages"])

    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    # linear warmup, then cosine decay to zero
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * s / STEPS)))
    rng = np.random.default_rng(0)
    model.train()
    for _ in range(STEPS):
        batch = torch.from_numpy(rng.choice(len(ids), BATCH_SIZE, replace=False))
        loss = model(input_ids=ids[batch], attention_mask=mask[batch], labels=labels[batch]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    model.eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


if __name__ == "__main__":  # the clean build process of cached_build
    build(sys.argv[1])
