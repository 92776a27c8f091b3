"""Build the embedded default model: a tiny Llama causal LM and a byte-level BPE chat tokenizer.

Built deterministically from code on first use and cached on disk, so the rest of the stack loads it with the
ordinary ``from_pretrained(path)``. The same directory serves as a sequence-classification (reward) base.
"""

import os
import sys

from trl_ext.assets.cache import cached_build

DEFAULT_MODEL_NAME = "trl-ext/tiny-llama"  # resolved to a local build, never fetched from the Hub
_BUILD_DIR_NAME = "tiny-llama-v2"  # bump when the build changes
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
# ChatML with {% generation %} markers, so SFT can train on assistant tokens only (assistant_only_loss=True).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MODEL_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def default_model_path() -> str:
    """Return the local path of the embedded model, building it on first use."""
    return cached_build(_BUILD_DIR_NAME, __name__)


def _training_corpus() -> list[str]:
    from trl_ext.assets.datasets import DATA_DIR

    return [line for path in sorted(DATA_DIR.glob("sft_*.jsonl")) for line in path.read_text().splitlines()]


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
    )


def build(path: str | os.PathLike, model_config: dict | None = None, seed: int = 0) -> None:
    """Write the tokenizer and a freshly initialised tiny Llama (the same bytes on every CPU) to ``path``.

    Args:
        path: The directory to write.
        model_config: ``LlamaConfig`` sizes; ``MODEL_CONFIG`` (this model's) by default.
        seed: The initialisation's seed.
    """
    import numpy as np
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **(MODEL_CONFIG if model_config is None else model_config),
    )
    model = LlamaForCausalLM(config)
    # numpy's generator, not torch's: torch's vectorised normal_ gives other values on other CPU instruction sets
    # (AVX-512 vs AVX2 vs ATEN_CPU_CAPABILITY=default), and the same build must give the same model on every machine.
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:  # matrices and embeddings, as transformers initialises them; norms stay at one
                param.copy_(torch.from_numpy(rng.normal(0.0, config.initializer_range, param.shape)))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        max_new_tokens=8,
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


if __name__ == "__main__":  # the clean build process of cached_build
    build(sys.argv[1])
