"""`trl-ext verify` on good checkpoints and on the broken ones from user reports (built here as fixtures)."""

import json
import shutil

import pytest
import torch
from peft import LoraConfig, TaskType, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig, LlamaForCausalLM

from trl_ext.cli import main as cli
from trl_ext.errors import CheckpointError
from trl_ext.files.audit import audit, verify_or_raise

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def good_adapter(tmp_path_factory, tiny_model_path):
    path = tmp_path_factory.mktemp("ckpt") / "good_adapter"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), LoraConfig(**LORA))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def good_reward_adapter(tmp_path_factory, tiny_model_path):
    path = tmp_path_factory.mktemp("ckpt") / "good_reward"
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    get_peft_model(base, LoraConfig(task_type=TaskType.SEQ_CLS, **LORA)).save_pretrained(path)
    return path


def _rewrite(src, dst, edit):
    shutil.copytree(src, dst)
    weights = load_file(dst / "adapter_model.safetensors")
    save_file(edit(weights), dst / "adapter_model.safetensors")
    return dst


def run_cli(capsys, *args):
    code = cli(["verify", *map(str, args)])
    return code, capsys.readouterr().out


def test_good_checkpoints_pass(capsys, good_adapter, good_reward_adapter, tiny_model_path):
    for path in (good_adapter, good_reward_adapter):
        code, out = run_cli(capsys, path, "--base", tiny_model_path)
        assert code == 0, out
        assert "adapter checkpoint" in out and "OK" in out
    code, out = run_cli(capsys, tiny_model_path)
    assert code == 0 and "full checkpoint" in out


def test_empty_zero3_placeholders(capsys, good_adapter, tmp_path):
    broken = _rewrite(good_adapter, tmp_path / "empty",
                      lambda w: {k: (torch.empty(0) if "lora_B" in k else v) for k, v in w.items()})
    code, out = run_cli(capsys, broken)
    assert code == 1
    assert "4 empty tensors" in out and "lora_B.weight [0]" in out and "ZeRO-3 placeholders" in out
    with pytest.raises(CheckpointError, match="empty tensors"):
        verify_or_raise(str(broken))


def test_adapter_name_in_keys(capsys, good_adapter, tmp_path):
    broken = _rewrite(good_adapter, tmp_path / "named",
                      lambda w: {k.replace(".weight", ".default.weight"): v for k, v in w.items()})
    code, out = run_cli(capsys, broken)
    assert code == 1 and "carry the adapter name '.default'" in out


def test_lora_weights_missing_for_targeted_modules(capsys, good_reward_adapter, good_adapter, tmp_path,
                                                  tiny_model_path):
    """PEFT's key mapping under activation-checkpoint wrappers keeps only the head: the adapter would load untrained."""
    head_only = _rewrite(good_reward_adapter, tmp_path / "head_only",
                         lambda w: {k: v for k, v in w.items() if "lora_" not in k})
    code, out = run_cli(capsys, head_only)
    assert code == 1 and "holds no LoRA weights" in out and "untrained base model" in out
    one_layer = _rewrite(good_adapter, tmp_path / "one_layer",
                         lambda w: {k: v for k, v in w.items() if "layers.1." not in k})
    code, out = run_cli(capsys, one_layer, "--base", tiny_model_path)
    assert code == 1 and "2 targeted modules have no LoRA weights saved (e.g. model.layers.1.self_attn" in out, out


def test_lora_wrapped_reward_head(capsys, tmp_path, tiny_model_path):
    """TRL 1.16 with target_modules='all-linear' and no task_type: only score.lora_A/B are saved."""
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    path = tmp_path / "lora_head"
    get_peft_model(base, LoraConfig(r=4, target_modules="all-linear")).save_pretrained(path)
    code, out = run_cli(capsys, path)
    assert code == 1 and "the head 'score' was LoRA-wrapped" in out and "modules_to_save" in out


def test_reward_head_missing_or_wrong_size(capsys, good_reward_adapter, tmp_path, tiny_model_path):
    missing = _rewrite(good_reward_adapter, tmp_path / "no_head",
                       lambda w: {k: v for k, v in w.items() if ".score." not in k})
    code, out = run_cli(capsys, missing)
    assert code == 1 and "no head weights" in out

    full = tmp_path / "two_labels"
    AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=2).save_pretrained(full)
    code, out = run_cli(capsys, full)
    assert code == 1 and "declares 2 labels" in out and "num_labels=1" in out
    assert run_cli(capsys, full, "--num-labels", "2")[0] == 0


def test_adapter_shapes_against_another_base(capsys, good_adapter, tmp_path, tiny_model_path):
    other = tmp_path / "wider"
    config = LlamaConfig.from_pretrained(tiny_model_path)
    config.hidden_size, config.intermediate_size = 96, 192
    LlamaForCausalLM(config).save_pretrained(other)
    code, out = run_cli(capsys, good_adapter, "--base", other)
    assert code == 1 and "do not match the base model" in out and "in_features" in out


def test_corrupted_and_missing_files(capsys, good_adapter, tmp_path):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(good_adapter, corrupt)
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    code, out = run_cli(capsys, corrupt)
    assert code == 1 and "cannot be read as safetensors" in out

    no_config = tmp_path / "no_config"
    shutil.copytree(good_adapter, no_config)
    (no_config / "adapter_config.json").unlink()
    assert "adapter_config.json is missing" in run_cli(capsys, no_config)[1]

    assert "no adapter_model.safetensors" in audit(str(tmp_path)).format()


def test_sharded_index_with_missing_shard(capsys, tmp_path, tiny_model_path):
    path = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_model_path).save_pretrained(path, max_shard_size="100KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert run_cli(capsys, path)[0] == 0
    (path / shards[-1]).unlink()
    code, out = run_cli(capsys, path)
    assert code == 1 and "shards that do not exist" in out


def test_nested_modules_to_save_are_found(capsys, tmp_path, tiny_model_path):
    path = tmp_path / "embed"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    get_peft_model(model, LoraConfig(modules_to_save=["embed_tokens"], **LORA)).save_pretrained(path)
    code, out = run_cli(capsys, path, "--base", tiny_model_path)
    assert code == 0, out


def test_reader_agrees_with_safe_open_and_rejects_what_it_rejects(tmp_path):
    """verify.read_safetensors parses headers itself (one pass, memory-mapped): it must read what safe_open reads and
    refuse every file safe_open refuses."""
    from safetensors import SafetensorError, safe_open

    from trl_ext.files.audit import UNREADABLE, read_safetensors

    tensors = {"w": torch.randn(3, 700), "h": torch.randn(5).half(), "b": torch.randn(2, 2).bfloat16(),
               "i": torch.arange(4), "m": torch.tensor([True, False]), "e": torch.empty(0, 4), "s": torch.tensor(1.5)}
    good = tmp_path / "good.safetensors"
    save_file(tensors, good)
    found, prefixes = read_safetensors(good)
    with safe_open(str(good), framework="pt") as f:
        assert found == {n: (list(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype()) for n in f.keys()}  # noqa: SIM118
    for name, tensor in tensors.items():
        assert prefixes[name] == tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()[:4096], name

    raw = good.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])

    def with_header(edit):
        entries = json.loads(json.dumps(header))
        edit(entries)
        text = json.dumps(entries).encode()
        text += b" " * (-len(text) % 8)
        return len(text).to_bytes(8, "little") + text + raw[8 + length:]

    broken = {
        "truncated": raw[:-10],
        "longer": raw + b"\0" * 8,
        "tiny": raw[:5],
        "header_too_long": (10**9).to_bytes(8, "little") + raw[8:],
        "not_json": raw[:8] + b"x" + raw[9:],
        "size_mismatch": with_header(lambda h: h["w"].update(shape=[3, 699])),
        "gap": with_header(lambda h: h["h"].update(data_offsets=[h["h"]["data_offsets"][0] + 2,
                                                                 h["h"]["data_offsets"][1] + 2])),
        "no_offsets": with_header(lambda h: h["i"].pop("data_offsets")),
    }
    for label, data in broken.items():
        path = tmp_path / f"{label}.safetensors"
        path.write_bytes(data)
        with pytest.raises(UNREADABLE):
            read_safetensors(path)
        with pytest.raises(SafetensorError), safe_open(str(path), framework="pt") as f:  # safe_open refuses it too
            [f.get_tensor(n) for n in f.keys()]  # noqa: SIM118


def test_nan_or_inf_in_any_tensor(capsys, good_adapter, tmp_path):
    def poison(w):
        last = max(w)  # the check covers every tensor's leading values, not only the first few
        w[last] = w[last].clone()
        w[last].view(-1)[3] = float("nan")
        return w

    broken = _rewrite(good_adapter, tmp_path / "nan", poison)
    code, out = run_cli(capsys, broken)
    assert code == 1 and "1 tensors contain NaN or inf values" in out
    assert max(load_file(broken / "adapter_model.safetensors")) in out


def test_fsdp2_wrapper_class_in_architectures_is_flagged_with_a_fix_that_works(capsys, tiny_model_path, tmp_path):
    """A full save written under FSDP2 by a tool that names type(model) (FSDPLlamaForCausalLM) loads in transformers
    but no serving engine; verify says so and prints a one-line repair, which makes the checkpoint pass."""
    import shlex
    import subprocess

    broken = tmp_path / "fsdp2_save"
    shutil.copytree(tiny_model_path, broken)
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["FSDPLlamaForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config, indent=2))
    code, out = run_cli(capsys, broken)
    assert code == 1 and "'FSDPLlamaForCausalLM', FSDP2's wrapper class of LlamaForCausalLM" in out, out
    fix = out.split("Fix: ", 1)[1].splitlines()[0]
    subprocess.run(shlex.split(fix), check=True)
    code, out = run_cli(capsys, broken)
    assert code == 0, out
    assert json.loads((broken / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_unknown_architecture_is_flagged_unless_remote_code_defines_it(capsys, tiny_model_path, tmp_path):
    path = tmp_path / "custom"
    shutil.copytree(tiny_model_path, path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["MyLlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    code, out = run_cli(capsys, path)
    assert code == 1 and "'MyLlamaForCausalLM', which transformers does not export" in out, out
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_my.MyLlamaForCausalLM"}  # trust_remote_code models
    (path / "config.json").write_text(json.dumps(config))
    assert run_cli(capsys, path)[0] == 0


def test_adapter_whose_auto_mapping_names_the_fsdp2_wrapper_is_flagged(capsys, good_adapter, tmp_path):
    path = tmp_path / "adapter"
    shutil.copytree(good_adapter, path)
    config = json.loads((path / "adapter_config.json").read_text())
    config["task_type"] = None
    config["auto_mapping"] = {"base_model_class": "FSDPLlamaForCausalLM", "parent_library": "transformers.models"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    code, out = run_cli(capsys, path)
    assert code == 1 and "auto_mapping names 'FSDPLlamaForCausalLM'" in out, out
