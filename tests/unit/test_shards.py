"""The streaming safetensors writer: files that safetensors and transformers read back bit for bit."""

import json
import types

import pytest
import torch
from safetensors import safe_open

from trl_ext.errors import CheckpointError
from trl_ext.files import shards
from trl_ext.files.shards import ShardStreamWriter, TensorSpec, index_json, parse_size, plan_shards


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(7, 5, generator=g),
        "a.bias_bf16": torch.randn(5, generator=g).to(torch.bfloat16),
        "b.half": torch.randn(3, 3, generator=g).half(),
        "b.transposed": torch.randn(4, 6, generator=g).t(),  # non-contiguous
        "c.ids": torch.arange(11, dtype=torch.int64),
        "c.mask": torch.tensor([True, False, True]),
        "d.scalar": torch.tensor(2.5),
    }


def _write(directory, tensors, max_shard_size):
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    plan = plan_shards(specs, max_shard_size)
    writer = ShardStreamWriter(directory, plan)
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    writer.close()
    return plan, writer


@pytest.mark.parametrize("max_shard_size", ["1GB", 64])
def test_round_trip(tmp_path, max_shard_size):
    tensors = _tensors()
    plan, writer = _write(tmp_path, tensors, max_shard_size)
    assert (len(plan) == 1) == (max_shard_size == "1GB")
    read = {}
    for filename in plan:
        with safe_open(str(tmp_path / filename), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            read.update({n: f.get_tensor(n) for n in f.keys()})  # noqa: SIM118
    assert read.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name
    for filename, record in writer.written.items():  # what the post-save check compares the files with
        assert (tmp_path / filename).read_bytes().startswith(record.header)
        assert list(record.prefixes) == [s.name for s in plan[filename]]
        for name, prefix in record.prefixes.items():
            raw = tensors[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            assert prefix == raw[:shards.PREFIX_BYTES]


def test_plan_keeps_order_limits_size_and_isolates_big_tensors():
    specs = [TensorSpec(f"t{i}", (25,), torch.float32) for i in range(4)] + [TensorSpec("big", (1000,), torch.float32)]
    plan = plan_shards(specs, 200)  # 100 bytes per small tensor
    assert list(plan) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [[s.name for s in group] for group in plan.values()] == [["t0", "t1"], ["t2", "t3"], ["big"]]
    index = index_json(plan)
    assert index["metadata"]["total_size"] == 4400 and index["weight_map"]["big"] == "model-00003-of-00003.safetensors"
    assert list(plan_shards(specs, "1GB")) == ["model.safetensors"]
    assert list(plan_shards(specs, float("inf"), prefix="adapter_model")) == ["adapter_model.safetensors"]


def test_writer_refuses_placeholders_order_errors_and_missing_tensors(tmp_path):
    plan = plan_shards([TensorSpec("x", (4, 4), torch.float32), TensorSpec("y", (2,), torch.float32)], "1GB")
    writer = ShardStreamWriter(tmp_path, plan)
    with pytest.raises(CheckpointError, match=r"planned \(4, 4\).*placeholder"):
        writer.write("x", torch.empty(0))  # a ZeRO-3 partition that was never gathered
    with pytest.raises(CheckpointError, match="out of plan order"):
        writer.write("y", torch.zeros(2))
    writer.write("x", torch.zeros(4, 4))
    with pytest.raises(CheckpointError, match="1 planned tensors were never written, e.g. y"):
        writer.close()


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size("100KB") == 100_000
    assert parse_size(123) == 123 and parse_size("77") == 77


def test_header_is_aligned_json(tmp_path):
    _write(tmp_path, {"w": torch.ones(3)}, "1GB")
    raw = (tmp_path / "model.safetensors").read_bytes()
    size = int.from_bytes(raw[:8], "little")
    assert size % 8 == 0
    header = json.loads(raw[8 : 8 + size])
    assert header["w"] == {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}


def test_files_are_shared_between_writers_balanced_by_bytes():
    from trl_ext.saving.save_plan import WeightSet, assign_files, split_for_writers

    specs = [TensorSpec(f"t{i}", (n,), torch.float32) for i, n in enumerate([900, 100, 300, 300, 300, 300, 200, 600])]
    units = [types.SimpleNamespace(outputs=[s]) for s in specs]
    whole = WeightSet("", units, plan_shards(specs, "50GB"))
    assert len(whole.plan) == 1
    split = split_for_writers(whole, writers=2, max_shard_size="50GB", min_shard_size=1)
    assert len(split.plan) >= 2 * 2 and all(sum(s.nbytes for s in f) <= 3000 * 4 / 8 or len(f) == 1
                                            for f in split.plan.values())
    assert [s for f in split.plan.values() for s in f] == specs  # same tensors, same order
    owner = assign_files(split.plan, [0, 1])
    load = [sum(s.nbytes for f, fs in split.plan.items() for s in fs if owner[f] == r) for r in (0, 1)]
    assert min(load) > 0 and max(load) <= 1.25 * sum(load) / 2
    assert split_for_writers(whole, writers=1) is whole  # one writer: the user's shard size


def test_a_converted_unit_never_straddles_two_files():
    specs = [TensorSpec(n, (100,), torch.float32) for n in "abcde"]
    plan = plan_shards(specs, 800, together=[1, 3, 1])  # b, c, d converted together: 1200 bytes, one file
    assert [[s.name for s in f] for f in plan.values()] == [["a"], ["b", "c", "d"], ["e"]]
