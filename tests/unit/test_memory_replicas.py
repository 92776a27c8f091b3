"""The memory tier's transfers between two machines' first processes (trl_ext/saving/memory_replicas.py), in two
forked processes over gloo, as a ring: each sends its files to the other while receiving the other's. A file that
cannot be read on one side (gone before it was listed; a directory, which fails once the header has announced it)
ends the exchange with an error on that side only after every announced piece went through, so the partner is never
left waiting for the group's timeout (30 minutes in a run; 20 s here, and each process must end within 60 s)."""

from datetime import timedelta

import pytest

from tests.harness import forked_ranks
from trl_ext.errors import CheckpointError
from trl_ext.saving import memory_replicas


def _ring(rank: int, store: str, root: str, names: list[str], results) -> None:
    from pathlib import Path

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    here = Path(root) / f"machine-{rank}"
    try:
        got = memory_replicas.transfer(dist.group.WORLD, (1 - rank, here / "own", names), (1 - rank, here / "replica"))
        results.put((rank, "ok", sorted(got)))
    except CheckpointError as exc:
        results.put((rank, "error", str(exc)))
    finally:
        dist.destroy_process_group()


def _exchange(tmp_path, names: dict[int, list[str]]) -> dict:
    found = forked_ranks(_ring, lambda rank, results: (rank, str(tmp_path / "store"), str(tmp_path), names[rank],
                                                      results), hung="a machine was left waiting for its partner")
    return {rank: (status, value) for rank, status, value in found}


def _files(tmp_path) -> None:
    for rank in (0, 1):
        own = tmp_path / f"machine-{rank}" / "own"
        (own / "sub").mkdir(parents=True)
        (own / "model.safetensors").write_bytes(bytes(range(256)) * 1000 + bytes([rank]))
        (own / "sub" / "state.json").write_text(f'{{"rank": {rank}}}')
        (own / "empty").write_bytes(b"")
        (own / "not-a-file").mkdir()


def test_two_machines_exchange_their_parts_file_by_file(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_replicas, "CHUNK", 4096)  # many pieces, the last one short
    _files(tmp_path)
    names = ["model.safetensors", "sub/state.json", "empty"]
    got = _exchange(tmp_path, {0: names, 1: names})
    assert got == {0: ("ok", sorted(names)), 1: ("ok", sorted(names))}
    for rank in (0, 1):
        for name in names:
            sent = tmp_path / f"machine-{1 - rank}" / "own" / name
            assert (tmp_path / f"machine-{rank}" / "replica" / name).read_bytes() == sent.read_bytes()


@pytest.mark.parametrize("bad", ["gone", "not-a-file"])
def test_a_file_one_side_cannot_read_fails_that_side_after_the_exchange_and_never_hangs_the_other(tmp_path, bad,
                                                                                                 monkeypatch):
    monkeypatch.setattr(memory_replicas, "CHUNK", 4096)
    _files(tmp_path)
    names = ["model.safetensors", "sub/state.json", "empty"]
    got = _exchange(tmp_path, {0: names, 1: ["model.safetensors", bad, "sub/state.json"]})
    assert got[1][0] == "error" and got[1][1].startswith(f"saving failed: could not read {bad}"), got
    # machine 0 had every piece machine 1 announced (a directory is announced by its size, then cannot be read); the
    # run's agreement on the outcome keeps this replica from counting
    announced = ["model.safetensors", "sub/state.json"] + (["not-a-file"] if bad == "not-a-file" else [])
    assert got[0] == ("ok", sorted(announced)), got
