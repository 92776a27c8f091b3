"""The embedded tiny VLM, the bundled shapes data, the VLM recipe configs and ``trl_ext.data.vision`` (one process)."""

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from tests.harness import REPO
from trl_ext import DPOConfig, ModelConfig, ScriptArguments, SFTConfig, TrlParser
from trl_ext.assets import (
    VLM_MODEL_NAME,
    answer_accuracy,
    load_dataset_by_name,
    load_shapes,
    resolve_model,
    vlm_model_path,
)
from trl_ext.data.vision import freeze_vision_tower, is_vision_model, vision_tower


@pytest.fixture(scope="module")
def vlm_path():
    return vlm_model_path()


def _digest(path: Path) -> str:
    files = (path / "model.safetensors").read_bytes() + (path / "tokenizer.json").read_bytes()
    return hashlib.sha256(files).hexdigest()


@pytest.mark.slow  # builds the model again in a fresh process
@pytest.mark.newest_only  # torch's kernels on each instruction set: the same torch in the oldest leg
def test_build_is_deterministic_on_every_cpu_instruction_set(tmp_path, vlm_path):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}  # ATen's baseline kernels: torch's own init would differ
    subprocess.run([sys.executable, "-m", "trl_ext.assets.tiny_vlm", str(tmp_path / "baseline")], env=env, check=True,
                   capture_output=True, cwd=REPO)
    assert _digest(tmp_path / "baseline") == _digest(Path(vlm_path))


def test_resolves_and_loads_with_the_auto_classes_without_torchvision(vlm_path):
    assert resolve_model(VLM_MODEL_NAME) == vlm_path and resolve_model("Qwen/Qwen2.5-VL-3B-Instruct").startswith("Qwen")
    processor = AutoProcessor.from_pretrained(vlm_path)
    assert type(processor).__name__ == "LlavaProcessor"
    assert type(processor.image_processor).__name__ == "CLIPImageProcessorPil"  # the PIL path: no torchvision
    model = AutoModelForImageTextToText.from_pretrained(vlm_path)
    assert type(model).__name__ == "LlavaForConditionalGeneration" and is_vision_model(VLM_MODEL_NAME)
    assert is_vision_model("trl-ext/tiny-llama") is False
    row = load_shapes("sft")["test"][0]
    batch = processor(images=row["images"], text=[processor.apply_chat_template(row["messages"])], return_tensors="pt")
    image_token = model.config.image_token_index
    assert (batch["input_ids"] == image_token).sum() == 16  # 32x32 in 8x8 patches, CLS dropped
    assert batch["pixel_values"].shape == (1, 3, 32, 32)
    assert model(**batch).logits.shape[1] == batch["input_ids"].shape[1]


def test_chat_template_marks_assistant_tokens(vlm_path):
    processor = AutoProcessor.from_pretrained(vlm_path)
    messages = load_shapes("sft")["train"][0]["messages"]
    out = processor.tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages], return_dict=True,
        return_assistant_tokens_mask=True)
    masked = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert processor.tokenizer.decode(masked) == messages[-1]["content"][0]["text"] + "<|im_end|>"


def test_shapes_are_deterministic_and_in_trl_vision_formats():
    first, again = load_shapes("sft"), load_dataset_by_name("trl-ext/shapes-sft")
    assert (len(first["train"]), len(first["test"])) == (480, 64)
    assert np.array_equal(np.asarray(first["test"][5]["images"][0]), np.asarray(again["test"][5]["images"][0]))
    assert first["train"][3]["messages"] == again["train"][3]["messages"]
    assert first["train"][0]["images"][0].size == (32, 32)
    pref = load_dataset_by_name("trl-ext/shapes-preference")["train"]
    assert set(pref.column_names) == {"prompt", "chosen", "rejected", "images"}
    assert all(r["chosen"] != r["rejected"] for r in pref.select(range(20)))
    answers = {m[-1]["content"][0]["text"] for m in first["train"]["messages"]}
    assert answers == {"red", "green", "blue", "yellow", "left", "right"}


def test_untrained_model_answers_nothing_right(vlm_path):
    processor = AutoProcessor.from_pretrained(vlm_path)
    model = AutoModelForImageTextToText.from_pretrained(vlm_path)
    assert answer_accuracy(model, processor, load_shapes("sft")["test"].select(range(8))) == 0.0


@pytest.mark.parametrize("recipe, config", [("sft", "sft_vlm"), ("dpo", "dpo_vlm"), ("sft", "sft_qwen2.5_vl_3b"),
                                            ("dpo", "dpo_qwen2.5_vl_3b")])
def test_vlm_configs_parse_and_target_the_language_model_only(recipe, config):
    from trl import get_peft_config

    parser = TrlParser((ScriptArguments, {"sft": SFTConfig, "dpo": DPOConfig}[recipe], ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(
        ["--config", str(REPO / "recipes" / "configs" / f"{config}.yaml")])
    assert training_args.gradient_checkpointing and training_args.max_length is None
    assert script_args.dataset_name and model_args.model_name_or_path
    pattern = get_peft_config(model_args).target_modules
    # Qwen2.5-VL's vision blocks have gate/up/down_proj too; LLaVA's CLIP has q/k/v_proj
    for name in ("model.language_model.layers.0.self_attn.q_proj", "model.language_model.layers.3.mlp.down_proj"):
        assert re.fullmatch(pattern, name), name
    for name in ("model.visual.blocks.0.mlp.gate_proj", "model.vision_tower.encoder.layers.0.self_attn.q_proj",
                 "model.multi_modal_projector.linear_1"):
        assert not re.fullmatch(pattern, name), name


def test_freeze_vision_tower(vlm_path):
    model = AutoModelForImageTextToText.from_pretrained(vlm_path)
    tower = vision_tower(model)
    assert tower is model.model.vision_tower
    assert freeze_vision_tower(model) == len(list(tower.parameters())) > 0
    assert not any(p.requires_grad for p in tower.parameters())
    assert all(p.requires_grad for n, p in model.named_parameters() if "language_model" in n)
    assert vision_tower(torch.nn.Linear(2, 2)) is None and freeze_vision_tower(torch.nn.Linear(2, 2)) == 0


def test_image_checks_accept_what_trl_trains_on(tmp_path):
    from datasets import Dataset, Image, Sequence

    from trl_ext.data.vision import check_image_dataset

    sft, pref = load_shapes("sft")["test"], load_shapes("preference")["test"]
    check_image_dataset(sft, "sft", True)
    check_image_dataset(pref, "pref", True)
    check_image_dataset(sft, "no model known", None)
    with mock.patch("trl_ext.data.vision._row_problem", side_effect=AssertionError("scanned again")):
        check_image_dataset(sft, "sft", True)  # checked once per run: not scanned again
    # text content with images: TRL's prepare_multimodal_messages inserts the placeholders itself
    sft[0]["images"][0].save(tmp_path / "a.png")
    text = [{"role": "user", "content": "Colour?"}, {"role": "assistant", "content": "red"}]
    check_image_dataset(Dataset.from_dict({"messages": [text], "images": [[sft[0]["images"][0]]]}), "text", True)
    # images as paths to readable files, plain strings or a datasets Image column
    check_image_dataset(Dataset.from_dict({"messages": [text], "images": [[str(tmp_path / "a.png")]]}), "paths", True)
    by_path = Dataset.from_dict({"messages": [text], "images": [[str(tmp_path / "a.png")]]})
    check_image_dataset(by_path.cast_column("images", Sequence(Image())), "image paths", True)
    # rows without images are left to the other checks
    check_image_dataset(Dataset.from_dict({"messages": [text]}), "no images", False)
