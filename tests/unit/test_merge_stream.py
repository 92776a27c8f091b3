"""`trl-ext merge` streamed (trl_ext.merge.streamed): each merged checkpoint equals PEFT's merge_and_unload tensor for
tensor and reloads, with plain transformers, to the adapter model's outputs; peak memory stays bounded; refusals are
one line with nothing written."""

import copy
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, TaskType, get_peft_model
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    CLIPVisionConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    MixtralConfig,
    MixtralForCausalLM,
)

from trl_ext.cli import main as cli

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]])
TEXT = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _save_base(model, directory: Path, **kwargs) -> Path:
    model.save_pretrained(directory, **kwargs)
    return directory


def _adapter(base_model, config: LoraConfig, directory: Path, seed: int = 0):
    """A trained-looking adapter on a copy of ``base_model`` (random LoRA B, perturbed saved modules), saved by PEFT."""
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base_model), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "modules_to_save" in name or "lora_magnitude" in name or name.endswith("lora_B.default.bias"):
                param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(directory)
    return model.eval()


def check_merge(tmp_path: Path, peft_model, adapter_dir: Path, base_dir: Path, loader, *args: str,
                inputs=IDS, compare_keys: bool = True) -> dict:
    """Merge through the CLI; compare with PEFT's merge_and_unload (tensor for tensor) and the adapter model's outputs
    after a plain transformers reload. Returns the measured differences."""
    out = tmp_path / "merged"
    assert cli(["merge", "--adapter", str(adapter_dir), "--out", str(out), "--base", str(base_dir), *args]) == 0
    reference = tmp_path / "peft-merged"
    copy.deepcopy(peft_model).merge_and_unload().save_pretrained(reference)
    got, expected = _tensors(out), _tensors(reference)
    if compare_keys:
        assert set(got) == set(expected)
    tensor_diff = max((got[k].float() - expected[k].float()).abs().max().item() for k in got.keys() & expected)
    assert tensor_diff <= 1e-6
    merged = loader.from_pretrained(out).eval()
    with torch.no_grad():
        want, have = peft_model(input_ids=inputs).logits, merged(input_ids=inputs).logits
    output_diff = (have - want).abs().max().item()
    assert output_diff <= 1e-5
    print(f"\nMAXDIFF {tmp_path.name}: tensors vs PEFT {tensor_diff:.3g}, outputs vs adapter model {output_diff:.3g}")
    return {"out": out, "tensors": got, "reference": expected, "merged": merged}


# ---------------------------------------------------------------- causal LM, variants of LoRA


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path)


@pytest.mark.parametrize("variant", [
    {"modules_to_save": ["lm_head"]},
    {"use_dora": True},
    {"use_rslora": True, "rank_pattern": {"q_proj": 16}, "alpha_pattern": {"v_proj": 32}},
], ids=["lora-lm_head", "dora", "rslora-patterns"])
def test_causal_lm(tmp_path, tiny_llama, tiny_model_path, variant):
    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False, **variant)
    model = _adapter(tiny_llama, config, tmp_path / "adapter")
    result = check_merge(tmp_path, model, tmp_path / "adapter", Path(tiny_model_path), AutoModelForCausalLM)
    assert (result["out"] / "tokenizer.json").exists() and (result["out"] / "chat_template.jinja").exists()


def test_a_base_saved_by_another_transformers_gives_the_files_save_pretrained_writes(tmp_path, tiny_llama):
    """A base whose files another transformers version wrote (a Hub model's, usually): the merged model's generation
    config is written as save_pretrained writes it, stamped with this version, not copied with the base's stamp."""
    from tests.metadata import compare_files

    base = _save_base(tiny_llama, tmp_path / "base")
    for name in ("config.json", "generation_config.json"):
        fields = json.loads((base / name).read_text())
        (base / name).write_text(json.dumps({**fields, "transformers_version": "4.0.0"}))
    model = _adapter(tiny_llama, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False),
                     tmp_path / "adapter")
    out = check_merge(tmp_path, model, tmp_path / "adapter", base, AutoModelForCausalLM)["out"]
    AutoModelForCausalLM.from_pretrained(out).save_pretrained(tmp_path / "resaved")
    assert compare_files(str(out), str(tmp_path / "resaved")) == []


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_bf16_base_is_bit_identical_to_peft(tmp_path, tiny_llama, dora):
    """A bf16 base with an fp32 adapter (PEFT's default dtypes): every merged tensor equals merge_and_unload's."""
    from peft import PeftModel

    base_dir = _save_base(copy.deepcopy(tiny_llama).to(torch.bfloat16), tmp_path / "base")
    config = LoraConfig(r=8, target_modules="all-linear", use_dora=dora, init_lora_weights=False)
    _adapter(tiny_llama, config, tmp_path / "adapter")
    assert cli(["merge", "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged"), "--base",
                str(base_dir)]) == 0
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    reference = PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload().state_dict()
    got = _tensors(tmp_path / "merged")
    assert set(got) == set(reference) and all(got[k].dtype == torch.bfloat16 for k in got)
    assert all(torch.equal(got[k], reference[k]) for k in got)


def test_reward_model(tmp_path, tiny_model_path):
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=8, target_modules="all-linear", init_lora_weights=False)
    model = _adapter(base, config, tmp_path / "adapter")
    assert "score" in model.peft_config["default"].modules_to_save
    result = check_merge(tmp_path, model, tmp_path / "adapter", Path(tiny_model_path),
                         AutoModelForSequenceClassification)
    config = json.loads((result["out"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    assert "lm_head.weight" not in result["tensors"] and result["tensors"]["score.weight"].shape == (1, 64)
    assert not (result["out"] / "generation_config.json").exists()


def test_fan_in_fan_out_and_lora_bias(tmp_path):
    """GPT-2's Conv1D layers store weights transposed (PEFT: fan_in_fan_out); lora_bias merges into their biases."""
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64))
    base_dir = _save_base(base, tmp_path / "base")
    config = LoraConfig(r=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True, lora_bias=True,
                        init_lora_weights=False)
    model = _adapter(base, config, tmp_path / "adapter")
    result = check_merge(tmp_path, model, tmp_path / "adapter", base_dir, AutoModelForCausalLM)
    assert "lm_head.weight" not in result["tensors"]  # still tied, as the base


# ---------------------------------------------------------------- MoE, VLM: checkpoint names differ from PEFT's


def test_moe_attention(tmp_path):
    """Mixtral's checkpoint keeps `block_sparse_moe.experts.N.w1` (fused `mlp.experts` in memory) and
    `block_sparse_moe.gate` (`mlp.gate` in memory): LoRA on attention, the router trained whole."""
    torch.manual_seed(0)
    base = MixtralForCausalLM(MixtralConfig(**TEXT, num_local_experts=4, num_experts_per_tok=2))
    base_dir = _save_base(base, tmp_path / "base")
    config = LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], modules_to_save=["gate"],
                        init_lora_weights=False)
    model = _adapter(base, config, tmp_path / "adapter")
    result = check_merge(tmp_path, model, tmp_path / "adapter", base_dir, AutoModelForCausalLM)
    names = set(result["tensors"])
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    assert "model.layers.1.block_sparse_moe.gate.weight" in names and not any(".mlp." in n for n in names)


def test_vlm(tmp_path):
    """LLaVA (CLIP vision + Llama): the checkpoint's `language_model.model.layers...` are PEFT's
    `model.language_model.layers...`; LoRA on every linear layer (text, vision, projector), lm_head trained whole."""
    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=32, patch_size=8)
    base = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=LlamaConfig(**TEXT),
                                                     image_token_index=127))
    base_dir = _save_base(base, tmp_path / "base")
    config = LoraConfig(r=8, target_modules="all-linear", modules_to_save=["lm_head"], init_lora_weights=False)
    model = _adapter(base, config, tmp_path / "adapter")
    result = check_merge(tmp_path, model, tmp_path / "adapter", base_dir, LlavaForConditionalGeneration)
    assert "language_model.lm_head.weight" in result["tensors"]


# ---------------------------------------------------------------- embeddings


def test_resized_embeddings(tmp_path, tiny_model_path):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    base.resize_token_embeddings(416)  # new tokens; the adapter saves both embeddings whole
    config = LoraConfig(r=8, target_modules="all-linear", modules_to_save=["embed_tokens", "lm_head"],
                        init_lora_weights=False)
    model = _adapter(base, config, tmp_path / "adapter")
    inputs = torch.tensor([[5, 6, 400, 410, 415, 7]])
    result = check_merge(tmp_path, model, tmp_path / "adapter", Path(tiny_model_path), AutoModelForCausalLM,
                         inputs=inputs)
    assert json.loads((result["out"] / "config.json").read_text())["vocab_size"] == 416


def test_tied_embeddings_changed(tmp_path):
    """On a tied base, LoRA on embed_tokens changes the input embedding only: the merged model stores both and is
    untied, so it computes what the adapter model computes. (PEFT's merge_and_unload adds the delta to the shared
    tensor, so its lm_head changes too; every other tensor is the same.)"""
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**TEXT, tie_word_embeddings=True))
    base_dir = _save_base(base, tmp_path / "base")
    config = LoraConfig(r=8, target_modules=["embed_tokens", "q_proj", "v_proj"], init_lora_weights=False)
    model = _adapter(base, config, tmp_path / "adapter")
    result = check_merge(tmp_path, model, tmp_path / "adapter", base_dir, AutoModelForCausalLM, compare_keys=False)
    tensors = result["tensors"]
    assert set(tensors) == set(result["reference"]) | {"lm_head.weight"}
    assert torch.equal(tensors["lm_head.weight"], load_file(str(base_dir / "model.safetensors"))[
        "model.embed_tokens.weight"])
    assert json.loads((result["out"] / "config.json").read_text())["tie_word_embeddings"] is False
    peft_merged = AutoModelForCausalLM.from_pretrained(tmp_path / "peft-merged")  # what merge_and_unload computes
    with torch.no_grad():
        assert (peft_merged(input_ids=IDS).logits - model(input_ids=IDS).logits).abs().max() > 1e-3


# ---------------------------------------------------------------- where the base comes from


def test_sharded_base_from_the_hub_cache(tmp_path, tiny_llama, monkeypatch):
    """A Hub id found in the local cache (offline), sharded into several files; the output sharded too."""
    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--someone--tiny" / "snapshots" / ("0" * 40)
    _save_base(copy.deepcopy(tiny_llama), snapshot, max_shard_size="100KB")  # save_pretrained renames the model
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    assert len(list(snapshot.glob("*.safetensors"))) > 2
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    config = LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False)
    model = _adapter(tiny_llama, config, tmp_path / "adapter")
    result = check_merge(tmp_path, model, tmp_path / "adapter", "someone/tiny", AutoModelForCausalLM,
                         "--max-shard-size", "100KB")
    index = json.loads((result["out"] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2


# ---------------------------------------------------------------- memory


RSS_WORKER = textwrap.dedent("""
    import sys, threading, time
    import peft.tuners.lora, psutil, tqdm.auto, transformers
    from transformers import AutoConfig, LlamaForCausalLM  # what the merge imports: its memory is not the merge's
    from trl_ext.merge.streamed import merge_streamed
    process, peak, running = psutil.Process(), [0], [True]
    def sample():
        while running[0]:
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.002)
    baseline = process.memory_info().rss
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    merge_streamed(sys.argv[1], sys.argv[2], base=sys.argv[3], progress=False)
    running[0] = False
    thread.join()
    print("GROWTH", peak[0] - baseline)
""")


@pytest.mark.slow  # 9 s on an idle 2-core machine, 25 s on a busy one: a 300 MB model, merged in a fresh process
@pytest.mark.newest_only  # the merge's own memory (safetensors and torch, the same versions in the oldest leg)
def test_peak_memory_stays_below_a_quarter_of_the_model(tmp_path):
    """A 288 MiB base whose (tied) embedding, 128 MiB, is larger than all the rest together: the merge's memory
    growth stays below a quarter of the model, and below that one tensor."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32768, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)
    base = LlamaForCausalLM(config)
    base_dir = _save_base(base, tmp_path / "base")
    size = sum(f.stat().st_size for f in base_dir.glob("*.safetensors"))
    lora = LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(base, lora).save_pretrained(tmp_path / "adapter")
    del base
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.run([sys.executable, "-c", RSS_WORKER, str(tmp_path / "adapter"), str(tmp_path / "merged"),
                          str(base_dir)], capture_output=True, text=True, env=env, check=False, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    growth = int(run.stdout.split("GROWTH")[-1])
    print(f"\nPEAKRSS growth {growth / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB model "
          f"(largest tensor {32768 * 1024 * 4 / 2**20:.0f} MiB)")
    assert growth < size / 4
    assert growth < 32768 * 1024 * 4  # not even the largest tensor is held whole


# ---------------------------------------------------------------- refusals: one line, exit 1, nothing written


def _refused(capsys, tmp_path, *argv: str) -> str:
    out = tmp_path / "refused-out"
    capsys.readouterr()  # drop what building the inputs printed
    assert cli(["merge", *argv, "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert not out.exists() and not list(tmp_path.glob(".refused-out*"))
    return err


def test_refusals(tmp_path, tiny_llama, tiny_model_path, capsys):
    base = str(tiny_model_path)
    lora = LoraConfig(r=8, target_modules=["q_proj"], init_lora_weights=False)
    _adapter(tiny_llama, lora, tmp_path / "a1")
    _adapter(tiny_llama, lora, tmp_path / "a2")

    assert "merge one at a time" in _refused(capsys, tmp_path, "--adapter", str(tmp_path / "a1"), "--adapter",
                                             str(tmp_path / "a2"))
    shutil.copytree(tmp_path / "a2", tmp_path / "a1" / "second")  # PEFT's layout for several adapters
    assert "holds several adapters" in _refused(capsys, tmp_path, "--adapter", str(tmp_path / "a1"))

    bin_base = tmp_path / "bin-base"
    bin_base.mkdir()
    shutil.copy(Path(base) / "config.json", bin_base)
    torch.save(tiny_llama.state_dict(), bin_base / "pytorch_model.bin")
    assert ".bin weights" in _refused(capsys, tmp_path, "--adapter", str(tmp_path / "a2"), "--base", str(bin_base))

    assert "local Hugging Face cache" in _refused(capsys, tmp_path, "--adapter", str(tmp_path / "a2"),
                                                             "--base", "nobody/no-such-model-here")

    dora_embedding = LoraConfig(r=8, target_modules=["embed_tokens"], use_dora=True, init_lora_weights=False)
    _adapter(tiny_llama, dora_embedding, tmp_path / "dora-emb")
    assert "is not something the streamed merge applies" in _refused(
        capsys, tmp_path, "--adapter", str(tmp_path / "dora-emb"), "--base", base)

    _adapter(tiny_llama, LoraConfig(r=8, target_modules=["q_proj"], lora_bias=True, init_lora_weights=False),
             tmp_path / "bias")
    assert "whose base layer has no bias" in _refused(capsys, tmp_path, "--adapter", str(tmp_path / "bias"), "--base",
                                                      base)

    from peft import IA3Config

    _adapter(tiny_llama, IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]),
             tmp_path / "ia3")
    assert "applies LoRA adapters only" in _refused(capsys, tmp_path, "--adapter", str(tmp_path / "ia3"), "--base",
                                                    base)


def test_lora_on_fused_experts_is_refused_by_the_stream_and_merged_in_memory_by_the_cli(tmp_path, capsys):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from trl_ext.errors import MergeError
    from trl_ext.merge.streamed import merge_streamed

    torch.manual_seed(0)
    base = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    base_dir = _save_base(base, tmp_path / "base")
    config = LoraConfig(r=8, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"],
                        init_lora_weights=False)
    peft_model = _adapter(base, config, tmp_path / "adapter")
    with pytest.raises(MergeError, match="fused MoE experts"):
        merge_streamed(str(tmp_path / "adapter"), str(tmp_path / "streamed"), base=str(base_dir), progress=False)
    assert not (tmp_path / "streamed").exists()
    check_merge(tmp_path, peft_model, tmp_path / "adapter", base_dir, Qwen3MoeForCausalLM)  # per-expert Hub tensors
    assert "merging in memory" in capsys.readouterr().err