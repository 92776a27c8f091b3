"""Tiny random-weight models of the families users fine-tune, built offline from their transformers configs.

Each is saved once with ``save_pretrained`` (the Hub's own format) under the trl_ext cache, with the embedded model's
chat tokenizer, so tests load it with the real ``from_pretrained(path)``. Dimensions are multiples of 32 and small
enough for 2-process ZeRO-3 on CPU. Run as ``python -m tests.families DIR`` this file builds every family, one
directory each, in one process (a fresh interpreter per family cost 5-6 s each of a cold fast tier).
"""

import os
import sys

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, head_dim=16)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
VISION_CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                   patch_size=8, projection_dim=32)

# family -> (kind, config class name, model class name, config kwargs); kind "vlm" models load as image-text-to-text
FAMILIES = {
    "llama": ("causal", "LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("causal", "Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases
    "qwen3": ("causal", "Qwen3Config", "Qwen3ForCausalLM", {}),  # q/k norms
    "gemma3": ("causal", "Gemma3TextConfig", "Gemma3ForCausalLM", {"tie_word_embeddings": True}),
    "phi3": ("causal", "Phi3Config", "Phi3ForCausalLM", {}),  # fused qkv_proj and gate_up_proj
    "mistral": ("causal", "MistralConfig", "MistralForCausalLM", {}),
    "qwen3_moe": ("causal", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**MOE, "num_experts": 4}),
    "mixtral": ("causal", "MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "glm4_moe": ("causal", "Glm4MoeConfig", "Glm4MoeForCausalLM",
                 {**MOE, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                  "topk_group": 1, "partial_rotary_factor": 0.5}),
    "qwen2_vl": ("vlm", "Qwen2VLConfig", "Qwen2VLForConditionalGeneration", {}),
    "llava": ("vlm", "LlavaConfig", "LlavaForConditionalGeneration", {}),
    "gemma3_vlm": ("vlm", "Gemma3Config", "Gemma3ForConditionalGeneration", {}),
}
_VERSION = "v2"  # bump when a build changes

# The text families vLLM's CPU build serves (tests/vllm), in head_dim-64 shapes (its attention refuses head_dim 16),
# each tied as its real small checkpoints are: Llama 3.2 1B/3B, Qwen2.5 up to 3B, Qwen3 up to 4B and Gemma 3 tie their
# embeddings; Phi-3, Mistral 7B, Qwen3-30B-A3B and Mixtral do not. "llama_untied" is the larger Llamas' shape.
VLLM_TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64, max_position_embeddings=256)
VLLM_FAMILIES = {"llama": True, "llama_untied": False, "qwen2": True, "qwen3": True, "gemma3": True, "phi3": False,
                 "mistral": False, "qwen3_moe": False, "mixtral": False}  # family -> tie_word_embeddings
_VLLM_VERSION = "v1"  # bump when a build changes


def _text_config(tokenizer, extra: dict) -> dict:
    return {**TEXT, "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, **extra}


def build_config(family: str, tokenizer, vllm: bool = False):
    """The family's transformers config, tiny, with the tokenizer's vocabulary and special tokens; with ``vllm``, a
    ``VLLM_FAMILIES`` name in the head_dim-64 shape, tied as ``VLLM_FAMILIES`` says."""
    import transformers

    if vllm:
        kind, config_name, _, extra = FAMILIES[family.removesuffix("_untied")]
        return getattr(transformers, config_name)(**{**_text_config(tokenizer, extra), **VLLM_TEXT,
                                                     "tie_word_embeddings": VLLM_FAMILIES[family]})
    kind, config_name, _, extra = FAMILIES[family]
    config_class = getattr(transformers, config_name)
    if kind == "causal":
        return config_class(**_text_config(tokenizer, extra))
    image_token = tokenizer.convert_tokens_to_ids("<|pad|>")  # text-only rows never use it; it must be in range
    if family == "qwen2_vl":
        vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=8,
                      spatial_merge_size=2, temporal_patch_size=2)
        return config_class(text_config=_text_config(tokenizer, {"rope_scaling": {"type": "mrope",
                                                                                  "mrope_section": [2, 2, 4]}}),
                            vision_config=vision, image_token_id=image_token, video_token_id=image_token)
    if family == "llava":
        return config_class(text_config={"model_type": "llama", **_text_config(tokenizer, {})},
                            vision_config={"model_type": "clip_vision_model", **VISION_CLIP},
                            image_token_index=image_token, vision_feature_layer=-1)
    siglip = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    return config_class(text_config=_text_config(tokenizer, {}), vision_config=siglip, mm_tokens_per_image=4,
                        image_token_index=image_token, boi_token_index=tokenizer.bos_token_id,
                        eoi_token_index=tokenizer.eos_token_id)


def build(family: str, path: str, vllm: bool = False) -> None:
    """Write the family's tiny model (seed 0, Hub format via ``save_pretrained``) and the chat tokenizer to ``path``;
    with ``vllm``, a ``VLLM_FAMILIES`` name in its vLLM shape."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from trl_ext.assets import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = build_config(family, tokenizer, vllm)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, FAMILIES[family.removesuffix("_untied")][2])(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def family_path(family: str) -> str:
    """The family's tiny model directory; every family is built on first use (once per machine, in a clean
    process)."""
    from trl_ext.assets.cache import cached_build

    root = cached_build(f"families-{_VERSION}", "tests.families", marker=f"{list(FAMILIES)[-1]}/config.json")
    return os.path.join(root, family)


def vllm_family_path(family: str) -> str:
    """The directory of a ``VLLM_FAMILIES`` model (head_dim 64); all are built on first use, in a clean process."""
    from trl_ext.assets.cache import cached_build

    root = cached_build(f"vllm-families-{_VLLM_VERSION}", "tests.families", "--vllm",
                        marker=f"{list(VLLM_FAMILIES)[-1]}/config.json")
    return os.path.join(root, family)


if __name__ == "__main__":
    vllm = sys.argv[1] == "--vllm"
    for name in VLLM_FAMILIES if vllm else FAMILIES:  # the last one written is cached_build's marker
        build(name, os.path.join(sys.argv[-1], name), vllm)
