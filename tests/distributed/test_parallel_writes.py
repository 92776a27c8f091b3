"""Every rank writes: under 4-process ZeRO-3 and FSDP2 each rank writes some of the weight files of every save (final
and checkpoint-N), balanced by bytes, and the result is what ``save_pretrained`` writes and reloads to the trained
outputs in a fresh process (``test_saving``'s checks). The SFT runs write checkpoint-2 in the background
(``save_in_background``; checkpoint-4, the last, and the final save in the foreground)."""

import json

import pytest

from tests.distributed.test_saving import assert_reload_identically

pytestmark = pytest.mark.slow

WORLD = 4
# 40 KB files: the tiny model (483 KB in fp32, its two largest tensors 93 KB) then has enough files to balance
RUNS = [("sft", ["--save_steps", "2", "--max_shard_size", "40KB", "--record_writes", "--save_in_background"]),
        ("reward", ["--max_shard_size", "40KB", "--record_writes"])]


@pytest.fixture(scope="module")
def four_ranks(shared_runs):
    """``four_ranks(backend, trainer)``: the output directory of ``save_roundtrip.py`` on 4 processes."""

    def run(backend: str, trainer: str):
        runs = [["--trainer", t, *a] for t, a in RUNS]
        shared_runs.many("save_roundtrip.py", backend, runs, num_processes=WORLD)
        return shared_runs.get("save_roundtrip.py", backend, runs[[t for t, _ in RUNS].index(trainer)],
                               num_processes=WORLD)

    return run


@pytest.mark.parametrize("backend", ["zero3", "fsdp2"])
@pytest.mark.parametrize("trainer", ["sft", "reward"])
def test_every_rank_writes_a_balanced_share_and_the_save_reloads(four_ranks, backend, trainer):
    out = four_ranks(backend, trainer)
    writes = [json.loads((out / f"writes_rank{r}.json").read_text()) for r in range(WORLD)]
    saves = ["final"] + (["checkpoint-2", "checkpoint-4"] if trainer == "sft" else [])
    for save in saves:
        per_rank = [w.get(save, 0) for w in writes]
        assert all(per_rank), f"{save}: a rank wrote nothing: {per_rank}"
        assert max(per_rank) <= 1.25 * sum(per_rank) / WORLD, f"{save}: unbalanced: {per_rank}"
    index = json.loads((out / "final" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= WORLD
    assert_reload_identically(out, saves, trainer)
    assert not list(out.glob(".*")), "partial directories were left behind"
