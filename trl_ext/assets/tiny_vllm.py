"""Build the embedded model vLLM serves on CPU: ``trl-ext/tiny-llama-vllm``, a tiny Llama with head_dim 64.

vLLM's CPU attention refuses head_dim 16 (``trl-ext/tiny-llama``'s: ``Unsupported CPU attention configuration``), so
GRPO/RLOO with ``use_vllm=True`` run offline on this one. Same tokenizer as ``trl-ext/tiny-llama``; built from code on
first use and cached like the others.
"""

import sys

from trl_ext.assets.cache import cached_build

VLLM_MODEL_NAME = "trl-ext/tiny-llama-vllm"  # resolved to a local build, never fetched from the Hub
_BUILD_DIR_NAME = "tiny-llama-vllm-v1"  # bump when the build changes
MODEL_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 64: the smallest vLLM's CPU attention takes
    num_key_value_heads=1,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def vllm_model_path() -> str:
    """Return the local path of the embedded head_dim-64 model, building it on first use."""
    return cached_build(_BUILD_DIR_NAME, __name__)


if __name__ == "__main__":  # the clean build process of cached_build
    from trl_ext.assets import tiny_model

    tiny_model.build(sys.argv[1], MODEL_CONFIG, seed=1)
