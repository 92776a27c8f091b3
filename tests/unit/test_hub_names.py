"""The Hub's layout in one process: plans match save_pretrained, converted groups stream, bad dtypes are refused."""

import glob
import json

import pytest
import safetensors.torch
import torch
import transformers
from peft import LoraConfig, get_peft_model
from safetensors import safe_open

from tests.families import FAMILIES, family_path
from trl_ext.errors import CheckpointError
from trl_ext.files import header as safetensors_header
from trl_ext.files import hub_names, shards
from trl_ext.files.audit import audit
from trl_ext.merge.weights import iter_merged_weights
from trl_ext.saving import pipeline as saving

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


def headers(directory) -> dict:
    out = {}
    for path in sorted(glob.glob(f"{directory}/*.safetensors")):
        with safe_open(path, framework="pt") as f:
            out.update({k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()})  # noqa: SIM118
    return out


@pytest.fixture(scope="module")
def mixtral():
    """A Mixtral: transformers 5 fuses its experts and renames block_sparse_moe on load."""
    return transformers.MixtralForCausalLM.from_pretrained(family_path("mixtral"))


def test_dtype_table_is_safetensors_own():
    assert {code: dtype for dtype, code in safetensors_header.DTYPE_CODES.items()} == safetensors.torch._TYPES


def test_plan_is_what_save_pretrained_writes_and_groups_one_module(mixtral):
    tensors = list(mixtral.state_dict(keep_vars=True).items())
    units = hub_names.plan(mixtral, tensors)
    converted = [u for u in units if u.converted]
    assert converted and all(len({n.rpartition(".")[0] for n, _ in u.sources}) == 1 for u in converted)
    planned = {s.name: list(s.shape) for u in units for s in u.outputs}
    assert planned == {k: v[0] for k, v in headers(family_path("mixtral")).items()}
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in planned
    assert hub_names.is_converted(mixtral)
    dense = transformers.LlamaForCausalLM.from_pretrained(family_path("llama"))
    assert not hub_names.is_converted(dense)
    assert all(not u.converted and u.outputs[0].name == u.sources[0][0]
               for u in hub_names.plan(dense, list(dense.state_dict().items())))


def test_sharded_save_splits_converted_groups_into_files_and_reloads(mixtral, tmp_path):
    saving.save(mixtral, tmp_path / "ours", max_shard_size="40KB")
    mixtral.save_pretrained(tmp_path / "theirs")
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert headers(tmp_path / "ours") == headers(tmp_path / "theirs")
    reloaded = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "ours")
    assert torch.equal(reloaded(IDS).logits, mixtral(IDS).logits)
    assert audit(str(tmp_path / "ours"), base=family_path("mixtral")).ok


def test_iter_merged_weights_equals_the_merged_models_hub_state_dict(tmp_path):
    torch.manual_seed(0)
    model = get_peft_model(transformers.MixtralForCausalLM.from_pretrained(family_path("mixtral")),
                           LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    streamed = dict(iter_merged_weights(model))
    model.merge_and_unload().save_pretrained(tmp_path / "hub")
    hub = safetensors.torch.load_file(str(tmp_path / "hub" / "model.safetensors"))
    assert set(streamed) == set(hub)
    assert all(torch.allclose(streamed[k], hub[k], atol=1e-6) for k in hub)


def test_an_unknown_dtype_is_refused_before_anything_is_written(tmp_path, tiny_model_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.register_buffer("odd", torch.zeros(2, dtype=torch.complex128))
    with pytest.raises(CheckpointError, match="safetensors cannot store torch.complex128; nothing was written"):
        saving.save(model, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_any_exception_while_writing_becomes_the_saves_error(tmp_path, tiny_model_path, monkeypatch):
    """The writing rank records every failure (not only OSError/ValueError) so it can tell the others."""
    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(shards.ShardStreamWriter, "append", broken)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with pytest.raises(CheckpointError, match="KeyError: 'boom'"):
        saving.save(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["gemma3", "phi3", "qwen2_vl"])
def test_single_process_saves_match_save_pretrained(family, tmp_path):
    model = getattr(transformers, FAMILIES[family][2]).from_pretrained(family_path(family))
    saving.save(model, tmp_path / "ours")
    assert headers(tmp_path / "ours") == headers(family_path(family))
