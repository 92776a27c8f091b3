"""Build the embedded tiny vision-language model: LLaVA-style (CLIP vision tower + projector + the tiny Llama).

``trl-ext/tiny-vlm`` is built deterministically from code on first use and cached like ``trl-ext/tiny-llama``, so it
loads with the ordinary ``AutoModelForImageTextToText.from_pretrained(path)`` and
``AutoProcessor.from_pretrained(path)``.
Its processor is a ``LlavaProcessor`` with the PIL image processor (no torchvision needed), the embedded tokenizer plus
an ``<image>`` token, and a chat template with ``{% generation %}`` markers (assistant-only loss works).
"""

import os
import sys

from trl_ext.assets.cache import cached_build
from trl_ext.assets.tiny_model import MODEL_CONFIG, SPECIAL_TOKENS, build_tokenizer

VLM_MODEL_NAME = "trl-ext/tiny-vlm"  # resolved to a local build, never fetched from the Hub
_BUILD_DIR_NAME = "tiny-vlm-v1"  # bump when the build changes
IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32
# One small CLIP layer: 32x32 images in 8x8 patches give 16 image tokens (the CLS token is dropped, as in LLaVA).
VISION_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     image_size=IMAGE_SIZE, patch_size=8, projection_dim=32)
# ChatML as in the tiny Llama; a message's content is text or TRL's list of {"type": "image"|"text"} parts.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}{{ '<image>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ render(message['content']) + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + render(message['content']) + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def vlm_model_path() -> str:
    """Return the local path of the embedded tiny VLM, building it on first use (once per machine, under a lock).

    Returns:
        The directory holding the model, its processor and its chat template.
    """
    return cached_build(_BUILD_DIR_NAME, __name__)


def build_processor():
    """The tiny VLM's processor: the PIL CLIP image processor, the embedded tokenizer plus ``<image>``, the template.

    Returns:
        A ``LlavaProcessor``.
    """
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [*SPECIAL_TOKENS[1:], IMAGE_TOKEN]})
    tokenizer.chat_template = CHAT_TEMPLATE
    # The PIL backend: transformers' default CLIP processor needs torchvision, which has no CPU build here.
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=VISION_CONFIG["patch_size"],
                          vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE,
                          image_token=IMAGE_TOKEN, num_additional_image_tokens=1)


def build(path: str | os.PathLike) -> None:
    """Write the processor and a freshly initialised tiny LLaVA (seed 0, the same bytes on every CPU) to ``path``.

    Args:
        path: An empty directory.
    """
    import numpy as np
    import torch
    from transformers import GenerationConfig, LlavaConfig, LlavaForConditionalGeneration

    processor = build_processor()
    tokenizer = processor.tokenizer
    text = dict(model_type="llama", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **MODEL_CONFIG)
    config = LlavaConfig(text_config=text, vision_config={"model_type": "clip_vision_model", **VISION_CONFIG},
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_select_strategy="default", vision_feature_layer=-1,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    model = LlavaForConditionalGeneration(config)
    # numpy's generator, not torch's: torch's vectorised normal_ gives other values on other CPU instruction sets.
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.dim() > 1:  # matrices, embeddings, the patch convolution; norms stay at one, biases at zero
                param.copy_(torch.from_numpy(rng.normal(0.0, 0.02, param.shape)))
            elif param.dim() == 1 and not torch.all(param == 1):
                param.zero_()  # CLIP's class embedding and biases: a fixed value, not torch's random one
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               pad_token_id=tokenizer.pad_token_id,
                                               eos_token_id=tokenizer.eos_token_id, max_new_tokens=8)
    model.save_pretrained(path)
    processor.save_pretrained(path)


if __name__ == "__main__":  # the clean build process of cached_build
    build(sys.argv[1])
