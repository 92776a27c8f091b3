"""`trl-ext merge` and `iter_merged_weights` in one process: standalone models equal to base + adapter."""

import copy
import json
import shutil

import pytest
import torch
from peft import LoraConfig, TaskType, get_peft_model
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
)

from trl_ext.cli import main as cli
from trl_ext.merge.weights import iter_merged_weights
from trl_ext.saving import pipeline as saving

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26]])


def _adapter(tmp_path, base_path, kind):
    """A trained-looking adapter (random LoRA B, perturbed head) written by trl_ext's save path."""
    torch.manual_seed(0)
    if kind == "reward":
        base = AutoModelForSequenceClassification.from_pretrained(base_path, num_labels=1)
        config = LoraConfig(task_type=TaskType.SEQ_CLS, r=4, target_modules="all-linear", init_lora_weights=False)
    else:
        base = AutoModelForCausalLM.from_pretrained(base_path)
        config = LoraConfig(r=4, target_modules="all-linear", modules_to_save=["lm_head"], init_lora_weights=False)
    model = get_peft_model(base, config)
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    model.get_base_model().config.pad_token_id = tokenizer.pad_token_id
    saving.save(model, tmp_path / f"{kind}-adapter", processing_class=tokenizer)
    model.eval()
    return model, tmp_path / f"{kind}-adapter"


def _keys(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("kind", ["causal", "reward"])
def test_merged_model_equals_base_plus_adapter(tmp_path, tiny_model_path, capsys, kind):
    model, adapter = _adapter(tmp_path, tiny_model_path, kind)
    assert cli(["merge", "--adapter", str(adapter), "--out", str(tmp_path / "merged")]) == 0
    assert "merged model saved to" in capsys.readouterr().out

    loader = AutoModelForSequenceClassification if kind == "reward" else AutoModelForCausalLM
    merged = loader.from_pretrained(tmp_path / "merged")  # plain transformers, no num_labels argument
    with torch.no_grad():
        assert torch.allclose(merged(IDS).logits, model(IDS).logits, atol=1e-5)
    keys = _keys(tmp_path / "merged")
    assert not [k for k in keys if "lora_" in k or "base_model" in k or "modules_to_save" in k or "base_layer" in k]
    assert keys == set(AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()) - {"lm_head.weight"} | (
        {"score.weight"} if kind == "reward" else {"lm_head.weight"})
    if kind == "reward":
        assert merged.config.num_labels == 1 and merged.config.pad_token_id is not None
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").chat_template


def test_refusals(tmp_path, tiny_model_path, capsys):
    _, adapter = _adapter(tmp_path, tiny_model_path, "causal")

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert cli(["merge", "--adapter", str(adapter), "--out", str(taken)]) == 1
    assert "already exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]

    other = tmp_path / "other-base"  # same architecture, different hidden size
    LlamaForCausalLM(LlamaConfig(vocab_size=365, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(other)
    assert cli(["merge", "--adapter", str(adapter), "--out", str(tmp_path / "m2"), "--base", str(other)]) == 1
    assert "does not fit this base model" in capsys.readouterr().err
    assert not (tmp_path / "m2").exists()

    quantized = tmp_path / "quantized-base"
    shutil.copytree(tiny_model_path, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantized / "config.json").write_text(json.dumps(config))
    assert cli(["merge", "--adapter", str(adapter), "--out", str(tmp_path / "m3"), "--base", str(quantized)]) == 1
    assert "quantized checkpoint (bitsandbytes)" in capsys.readouterr().err

    assert cli(["merge", "--adapter", str(tmp_path), "--out", str(tmp_path / "m4")]) == 1
    assert "adapter_config.json is missing" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["causal", "reward"])
def test_iter_merged_weights_uses_base_names_and_leaves_the_adapter_unmerged(tmp_path, tiny_model_path, kind):
    model, _ = _adapter(tmp_path, tiny_model_path, kind)
    with torch.no_grad():
        before = model(IDS).logits
    weights = dict(iter_merged_weights(model))

    merged = copy.deepcopy(model).merge_and_unload()
    expected = merged.state_dict()
    assert list(weights) == list(expected)  # the base model's own names, in its order
    for name, tensor in expected.items():
        assert torch.allclose(weights[name], tensor, atol=1e-6), name
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, before)  # still base + unmerged adapter
    assert not any(getattr(m, "merged", False) for m in model.modules())
