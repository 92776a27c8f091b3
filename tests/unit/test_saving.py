"""trl_ext's save path in one process: the same files as transformers/PEFT write, committed atomically, verified."""

import json
import os
import struct

import pytest
import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
)

from trl_ext.errors import CheckpointError
from trl_ext.files import header as safetensors_header
from trl_ext.files import shards
from trl_ext.files.audit import audit
from trl_ext.files.readback import check_written
from trl_ext.saving import pipeline as saving
from trl_ext.trainers import mixin

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


def _keys(path):
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def _perturbed(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


def test_full_model_sharded_reloads_identically(tmp_path, tiny_model_path):
    model = _perturbed(AutoModelForCausalLM.from_pretrained(tiny_model_path))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    saving.save(model, tmp_path / "ours", processing_class=tokenizer, max_shard_size="100KB")
    model.save_pretrained(tmp_path / "theirs")

    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert set(index["weight_map"]) == _keys(tmp_path / "theirs" / "model.safetensors")
    ours, theirs = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("ours", "theirs"))
    assert ours == theirs
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert torch.equal(reloaded(IDS).logits, model(IDS).logits)
    assert AutoTokenizer.from_pretrained(tmp_path / "ours").chat_template == tokenizer.chat_template
    assert audit(str(tmp_path / "ours"), base=tiny_model_path).ok


def test_tied_embeddings_saved_once_under_the_name_from_pretrained_expects(tmp_path):
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    saving.save(model, tmp_path / "ours")
    model.save_pretrained(tmp_path / "theirs")
    assert _keys(tmp_path / "ours" / "model.safetensors") == _keys(tmp_path / "theirs" / "model.safetensors")
    assert torch.equal(LlamaForCausalLM.from_pretrained(tmp_path / "ours")(IDS).logits, model(IDS).logits)


@pytest.mark.parametrize("kind", ["causal", "reward"])
def test_adapter_matches_peft_format_and_reloads(tmp_path, tiny_model_path, kind):
    if kind == "reward":
        def load():
            return AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
        config = LoraConfig(task_type=TaskType.SEQ_CLS, r=4, target_modules=["q_proj", "v_proj"],
                            init_lora_weights=False)
    else:
        load = lambda: AutoModelForCausalLM.from_pretrained(tiny_model_path)
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"],
                            init_lora_weights=False)
    model = get_peft_model(load(), config)
    saving.save(model, tmp_path / "ours")
    model.save_pretrained(tmp_path / "theirs")

    ours = _keys(tmp_path / "ours" / "adapter_model.safetensors")
    assert ours == _keys(tmp_path / "theirs" / "adapter_model.safetensors")
    assert not [k for k in ours if ".default" in k or "modules_to_save" in k]
    head = "score" if kind == "reward" else "lm_head"
    assert f"base_model.model.{head}.weight" in ours
    ours_config, theirs_config = (json.loads((tmp_path / d / "adapter_config.json").read_text())
                                  for d in ("ours", "theirs"))
    # PEFT writes its target_modules set in iteration order, which varies with PYTHONHASHSEED; ours is sorted
    assert ours_config["target_modules"] == sorted(theirs_config["target_modules"])
    ours_config.pop("target_modules"), theirs_config.pop("target_modules")
    assert ours_config == theirs_config
    reloaded = PeftModel.from_pretrained(load(), tmp_path / "ours")
    assert torch.equal(reloaded(IDS).logits, model(IDS).logits)


def test_commit_into_a_directory_that_holds_other_things(tmp_path, tiny_model_path):
    target = tmp_path / "run"
    (target / "checkpoint-5").mkdir(parents=True)
    (target / "notes.txt").write_text("mine")
    for stale in ("model-00001-of-00009.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
        (target / stale).write_text("from an older save")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    saving.save(model, target)
    names = set(os.listdir(target))
    assert {"checkpoint-5", "notes.txt", "model.safetensors", "config.json"} <= names
    assert not names & {"model-00001-of-00009.safetensors", "model.safetensors.index.json", "pytorch_model.bin"}
    assert not [n for n in names | set(os.listdir(tmp_path)) if "trl_ext" in n]
    assert torch.equal(AutoModelForCausalLM.from_pretrained(target)(IDS).logits, model(IDS).logits)


def test_failed_write_leaves_previous_save_untouched(tmp_path, tiny_model_path, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    saving.save(model, tmp_path / "out")
    before = (tmp_path / "out" / "model.safetensors").read_bytes()

    def disk_full(self, piece):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shards.ShardStreamWriter, "append", disk_full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        saving.save(_perturbed(model), tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["out"]  # the partial files are gone


def test_failed_verification_commits_nothing_and_keeps_files_for_inspection(tmp_path, tiny_model_path, monkeypatch):
    monkeypatch.setattr(saving.readback, "check_directory",
                        lambda *a: ["model.layers.0.mlp.up_proj.weight: written (0,), trained (..)"])
    with pytest.raises(CheckpointError, match="(?s)failed verification.*up_proj"):
        saving.save(AutoModelForCausalLM.from_pretrained(tiny_model_path), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert (tmp_path / ".out.trl_ext-partial" / "model.safetensors").exists()


def test_check_written_catches_changed_bytes_and_missing_tensors(tmp_path):
    tensors = {"a": torch.arange(6.0), "b": torch.ones(2, 2)}
    specs = [shards.TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    plan = shards.plan_shards(specs, "1GB")
    writer = shards.ShardStreamWriter(tmp_path, plan)
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    writer.close()
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')  # save() writes it first
    assert check_written(str(tmp_path), plan, writer.written) == []

    raw = bytearray((tmp_path / "model.safetensors").read_bytes())
    raw[-1] ^= 0xFF  # flip bits in b's data
    (tmp_path / "model.safetensors").write_bytes(bytes(raw))
    assert "bytes differ from the trained values for b" in " ".join(check_written(str(tmp_path), plan,
                                                                                  writer.written))
    bigger = {"model.safetensors": specs + [shards.TensorSpec("c", (3,), torch.float32)]}
    assert "1 tensors missing, e.g. c" in " ".join(check_written(str(tmp_path), bigger, writer.written))

    def problems_with(data: bytes) -> str:
        (tmp_path / "model.safetensors").write_bytes(data)
        return " ".join(check_written(str(tmp_path), plan, writer.written))

    good = bytes(raw[:-1]) + bytes([raw[-1] ^ 0xFF])
    assert problems_with(good) == ""
    header = writer.written["model.safetensors"].header
    # A header that is not the one written is parsed in full, to name what differs (here: b saved as float16).
    other = safetensors_header.encode_header([specs[0], shards.TensorSpec("b", (4, 2), torch.float16)],
                                             {"format": "pt"})
    assert "b: written ([4, 2], 'F16'), trained ([2, 2], 'F32')" in problems_with(other + good[len(header):])
    assert "cannot be read back" in problems_with(good[:-4])  # truncated
    nan = bytearray(good)
    nan[len(header):len(header) + 4] = struct.pack("<f", float("nan"))
    assert "differ from the trained values for a" in problems_with(bytes(nan))
    assert "1 tensors contain NaN or inf values: a" in problems_with(bytes(nan))


def test_save_pretrained_guard_refuses_zero3_placeholders(tiny_model_path, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    mixin.guard_save_pretrained(model)
    model.save_pretrained(tmp_path / "whole")  # parameters are whole: a plain save goes through
    assert (tmp_path / "whole" / "model.safetensors").exists()

    for i, param in enumerate(model.parameters()):  # ZeRO-3 converts every parameter of the model
        param.ds_id, param.ds_numel, param.ds_shape = i, param.numel(), param.shape
    model.save_pretrained(tmp_path / "gathered")  # all gathered (inside GatheredParameters): goes through
    param = model.model.layers[0].mlp.up_proj.weight  # what ZeRO-3 leaves on a rank outside a gather
    param.data = torch.empty(0)
    with pytest.raises(RuntimeError, match=r"empty torch.Size\(\[0\]\).*trainer.save_model\(output_dir\)"):
        model.save_pretrained(tmp_path / "partitioned")
    assert not (tmp_path / "partitioned").exists()


def test_fsync_or_metadata_failure_commits_nothing(tmp_path, tiny_model_path, monkeypatch):
    """The checks run while the last file's fsync is in flight; its failure, like a failure writing config.json,
    still reaches the caller before anything is committed."""
    import errno

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    saving.save(model, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}

    def full_disk(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(shards.os, "fsync", full_disk)
        with pytest.raises(CheckpointError, match="syncing .* to disk: .*No space left on device"):
            saving.save(_perturbed(model), tmp_path / "out")

    def broken_metadata(*args):
        raise PermissionError(errno.EACCES, "Permission denied", "config.json")

    with monkeypatch.context() as patch:
        patch.setattr(saving, "write_metadata", broken_metadata)
        with pytest.raises(CheckpointError, match="writing the configuration files: PermissionError"):
            saving.save(_perturbed(model), tmp_path / "out")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert not (tmp_path / ".out.trl_ext-partial").exists()


@pytest.mark.parametrize("kind", ["full", "adapter-without-task-type"])
def test_fsdp2_class_swap_does_not_reach_the_metadata(tmp_path, tiny_model_path, kind):
    """FSDP2's fully_shard swaps the module's class for a generated FSDP<Class>; every file beside the weights is
    still what the unwrapped model's save_pretrained writes (engines serve by config.json's architectures[0], and
    AutoPeftModel imports adapter_config.json's base_model_class)."""
    from torch.distributed.fsdp import FSDPModule

    from tests.metadata import compare_files

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    if kind != "full":
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(tmp_path / "theirs")
    tokenizer.save_pretrained(tmp_path / "theirs")
    wrapped = model if kind == "full" else model.get_base_model()
    cls = type(wrapped)
    wrapped.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})  # what fully_shard does
    saving.save(model, tmp_path / "ours", processing_class=tokenizer)
    assert compare_files(tmp_path / "ours", tmp_path / "theirs") == []
    if kind == "full":
        assert json.loads((tmp_path / "ours" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    else:
        mapping = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["auto_mapping"]
        assert mapping["base_model_class"] == "LlamaForCausalLM"


def test_a_failed_write_on_a_nearly_full_disk_says_how_much_room_is_left(tmp_path, monkeypatch):
    """DCP's writer reports a full disk as a zip-position error: the message adds the disk's free space."""
    from types import SimpleNamespace

    from trl_ext.saving import deferred, write

    where = tmp_path / ".checkpoint-4.trl_ext-partial" / "checkpoint-4" / "optimizer_0"  # not created yet
    monkeypatch.setattr(write.shutil, "disk_usage", lambda path: SimpleNamespace(free=5 << 20))
    error = write.write_failed(str(where), RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos"))
    assert error.kind == "save" and "RuntimeError: [enforce fail" in str(error)
    assert f"(the disk holding {where} has 5 MiB free)" in str(error)

    def full():
        raise OSError(28, "No space left on device")

    error = deferred.write_synced(full, str(tmp_path / "optimizer.pt"))
    assert "No space left on device" in str(error) and "earlier saves are intact" in str(error)
    monkeypatch.setattr(write.shutil, "disk_usage", lambda path: SimpleNamespace(free=50 << 30))
    assert "MiB free" not in str(write.write_failed(str(where), RuntimeError("x")))  # plenty of room: not mentioned


def test_the_model_card_is_written_again_only_when_it_would_change(tmp_path):
    """TRL writes its model card at every checkpoint; trl_ext writes it once per run, and again when what it is made
    from, or the file, changed."""
    from trl_ext.saving.trainer_files import ModelCard

    card, writes = ModelCard(), []

    def write(text: str = "the card") -> None:
        writes.append(text)
        (tmp_path / "README.md").write_text(text)

    assert not card.current(("run",), str(tmp_path))
    card.write(write, ("run",), str(tmp_path))
    assert card.current(("run",), str(tmp_path)) and not card.current(("another name",), str(tmp_path))
    (tmp_path / "README.md").write_text("the card, edited by its user")
    assert not card.current(("run",), str(tmp_path))
    card.write(write, ("run",), str(tmp_path))
    card.forget()  # a new train()
    assert not card.current(("run",), str(tmp_path)) and writes == ["the card", "the card"]
