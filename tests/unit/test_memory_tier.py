"""The memory tier in one process (memory_checkpoint_steps, TRL_EXT_MEMORY_DIR): a memory checkpoint holds the same
files as the disk checkpoint of its step; only the newest is kept; a run that stopped resumes from it with
resume_from_checkpoint=True (said in one line) and ends where the uninterrupted run ends; a completed run gives its
memory back; a damaged, incomplete or foreign memory checkpoint is never resumed; a tier that does not fit is said and
training goes on with disk checkpoints. On several machines: which step the machines resume and what moves between
them, and a machine alone never resumes a checkpoint whose other parts are elsewhere."""

import hashlib
import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from datasets import Dataset
from safetensors.torch import load_file
from transformers import TrainerCallback

import trl_ext
from trl_ext.files import manifest
from trl_ext.saving import memory_tier
from trl_ext.saving.cost import MEMORY_PREFIX
from trl_ext.saving.memory_replicas import HOLDS, Plan, files_under, plan, read_holds, said, write_holds
from trl_ext.saving.memory_tier import MemoryTier

ROWS = [{"messages": [{"role": "user", "content": f"{i}+1?"}, {"role": "assistant", "content": f"{i + 1}"}]}
        for i in range(16)]


class FailOnceCommitted(TrainerCallback):
    """A bug at the end of step ``step``, once memory checkpoint ``committed`` and its manifest are in place (so that
    the test does not depend on how fast the background write is)."""

    def __init__(self, step: int, root: Path, committed: int):
        self.step, self.manifest = step, memory_tier.manifest_path(root / f"checkpoint-{committed}")

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            deadline = time.monotonic() + 60
            while not self.manifest.exists():
                assert time.monotonic() < deadline, f"{self.manifest} never appeared"
                time.sleep(0.01)
            raise KeyError(f"a bug at step {self.step}")


def _trainer(out: Path, tiny_model_path, callbacks=(), **config):
    config = {"max_steps": 6, "save_steps": 100, **config}
    args = trl_ext.SFTConfig(output_dir=str(out), seed=0, per_device_train_batch_size=2, report_to="none",
                             logging_steps=1, **config)
    return trl_ext.SFTTrainer(model=tiny_model_path, args=args, train_dataset=Dataset.from_list(ROWS),
                              callbacks=list(callbacks))


def _files(directory: Path) -> dict[str, str]:
    """Every file's digest, but training_args.bin (it records the options themselves) and the trainer state's
    save_steps (the runs compared save at different steps)."""
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())
             if p.is_file() and p.name not in ("training_args.bin", "trainer_state.json", HOLDS)}
    state = json.loads((directory / "trainer_state.json").read_text())
    state.pop("save_steps")
    return {**files, "trainer_state.json": state}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model_path):
    """The run without memory checkpoints, a disk checkpoint at every step."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    _trainer(out, tiny_model_path, save_steps=1).train()
    return out


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, tiny_model_path):
    """A run with memory_checkpoint_steps=2 that fails at step 3 once memory checkpoint-2 is committed: its output
    directory (no checkpoint) and memory tier."""
    tmp = tmp_path_factory.mktemp("stopped")
    out, memory_dir = tmp / "run", tmp / "shm"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRL_EXT_MEMORY_DIR", str(memory_dir))
        probe = _trainer(out, tiny_model_path, memory_checkpoint_steps=2)
        root = probe.checkpoints.memory.root
        trainer = _trainer(out, tiny_model_path, [FailOnceCommitted(3, root, 2)], memory_checkpoint_steps=2)
        with pytest.raises(KeyError, match="a bug at step 3"):
            trainer.train()
    return out, memory_dir, root, trainer


def test_a_memory_checkpoint_is_the_disk_checkpoint_of_its_step_kept_in_memory(stopped, uninterrupted):
    """Memory checkpoint-2 holds every file the uninterrupted run's checkpoint-2 holds, byte for byte (the trainer
    state included: it is taken at the same point of the step), beside its manifest, and a note that it is this one
    machine's whole part (for a run that grows to several machines); the output directory holds no checkpoint."""
    out, memory_dir, root, _ = stopped
    assert root.parent == memory_dir
    assert sorted(p.name for p in root.iterdir()) == [".checkpoint-2.manifest.json", "checkpoint-2",
                                                     memory_tier.NOTE]
    assert _files(root / "checkpoint-2") == _files(uninterrupted / "checkpoint-2")
    assert read_holds(root / "checkpoint-2") == {"machines": 1, "world": 1,
                                                 "parts": {0: files_under(root / "checkpoint-2")}}
    written = manifest.Manifest.from_json(memory_tier.manifest_path(root / "checkpoint-2").read_text())
    assert written.step == 2 and set(written.files) == {p.name for p in (root / "checkpoint-2").iterdir()}
    assert not [p for p in out.iterdir() if p.name.startswith("checkpoint-")]


def test_resume_true_takes_the_newer_memory_checkpoint_and_ends_as_the_uninterrupted_run(
        stopped, uninterrupted, tiny_model_path, monkeypatch, caplog):
    """resume_from_checkpoint=True with no disk checkpoint resumes memory checkpoint-2, says so in one line, and
    ends with the uninterrupted run's weights; only the newest memory checkpoint is kept while training (the resumed
    one until a newer one is committed); the completed run gives the tier's memory back. Each memory checkpoint's
    cost is logged under memory_checkpoint/."""
    out, memory_dir, root, _ = stopped
    monkeypatch.setenv("TRL_EXT_MEMORY_DIR", str(memory_dir))
    seen = []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append((state.global_step, sorted(p.name for p in root.glob("checkpoint-*"))))

    trainer = _trainer(out, tiny_model_path, [Watch()], memory_checkpoint_steps=2)
    with caplog.at_level(logging.WARNING, logger="trl_ext"):
        trainer.train(resume_from_checkpoint=True)
    said = [r.getMessage() for r in caplog.records if "resuming from" in r.getMessage()]
    assert said == [f"[trl_ext] resume_from_checkpoint=True: resuming from step 2 in memory ({root}/checkpoint-2); "
                    "none is on disk"], said
    # memory checkpoint-4 is written in the background, committed at a later step (under load, after the last one):
    # checkpoint-2 is kept until then, and nothing else is ever there
    assert seen[0] == (3, ["checkpoint-2"]), seen
    kept = (["checkpoint-2"], ["checkpoint-4"], ["checkpoint-2", "checkpoint-4"])
    assert all(names in kept for _, names in seen), seen
    assert not root.exists(), "a completed run keeps its memory checkpoints"
    costs = trainer.checkpoints.memory_history  # memory checkpoint-4's (6 is the final step: a disk one)
    assert len(costs) == 1 and costs[0].bytes > 0 and costs[0].write_s > 0
    assert "memory_checkpoint/held_s" in costs[0].metrics(MEMORY_PREFIX)
    final, expected = (load_file(run / "checkpoint-6" / "model.safetensors") for run in (out, uninterrupted))
    assert final.keys() == expected.keys()
    for name, tensor in final.items():
        assert tensor.equal(expected[name]), name


def test_a_damaged_incomplete_or_foreign_memory_checkpoint_is_never_resumed(tmp_path):
    """A memory checkpoint is resumed only when its manifest is there and every file matches it, and only into the
    output directory it was taken for (not one made again at the same path)."""
    out = tmp_path / "run"
    out.mkdir()
    tier = MemoryTier(tmp_path / "shm" / "key", 2, str(out))
    tier.share_token(SimpleNamespace(output_dir=str(out)), create=True)
    tier.begin(None)
    for step in (2, 4):
        checkpoint = tier.root / f"checkpoint-{step}"
        checkpoint.mkdir()
        (checkpoint / "model.safetensors").write_bytes(bytes(range(step * 10)))
        (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        tier.committed(checkpoint, step)
    assert sorted(p.name for p in tier.root.glob("checkpoint-*")) == ["checkpoint-4"]  # the newest kept
    assert tier.newest() == (str(tier.root / "checkpoint-4"), None)
    # a later one committed without its manifest (killed in between): passed over, said
    (tier.root / "checkpoint-6").mkdir()
    path, line = tier.newest()
    assert path == str(tier.root / "checkpoint-4") and "checkpoint-6 is not resumed" in line and "manifest" in line
    # a changed file (same size): never resumed
    (tier.root / "checkpoint-6").rmdir()
    damaged = tier.root / "checkpoint-4" / "model.safetensors"
    data = bytearray(damaged.read_bytes())
    data[0] ^= 1
    damaged.write_bytes(bytes(data))
    path, line = tier.newest()
    assert path is None and "checksum" in line, line
    # the output directory made again at the same path: the tier is not its own
    damaged.write_bytes(bytes(range(40)))
    assert tier.newest()[0] == str(tier.root / "checkpoint-4")
    for path in out.iterdir():
        path.unlink()
    out.rmdir()
    out.mkdir()
    tier.share_token(SimpleNamespace(output_dir=str(out)), create=False)  # what the new run's rank 0 reads
    assert not tier.belongs_here() and tier.newest() == (None, None)


def test_a_tier_that_does_not_fit_is_said_and_training_goes_on_with_disk_checkpoints(
        tmp_path, tiny_model_path, monkeypatch, caplog):
    """Where two memory checkpoints do not fit in TRL_EXT_MEMORY_DIR's file system, the run says so in one line at
    the end of its first step, takes no memory checkpoint and trains on with its disk checkpoints."""
    monkeypatch.setenv("TRL_EXT_MEMORY_DIR", str(tmp_path / "shm"))
    monkeypatch.setattr(memory_tier.shutil, "disk_usage", lambda path: type("U", (), {"free": 1000})())
    trainer = _trainer(tmp_path / "run", tiny_model_path, memory_checkpoint_steps=1, save_steps=2)
    with caplog.at_level(logging.WARNING, logger="trl_ext"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "memory_checkpoint_steps" in r.getMessage()]
    assert len(said) == 1 and "no checkpoints in memory, because two checkpoints" in said[0], said
    assert not trainer.checkpoints.memory_history and trainer.checkpoints.memory.why_off
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == [f"checkpoint-{s}" for s in (2, 4, 6)]


def test_a_memory_dir_that_cannot_be_written_is_said_and_training_goes_on(tmp_path, tiny_model_path, monkeypatch,
                                                                         caplog):
    """TRL_EXT_MEMORY_DIR where nothing can be written (a file in the way): one line when training starts, no memory
    checkpoint, training goes on with its disk checkpoints."""
    (tmp_path / "blocked").write_text("a file, not a directory")
    monkeypatch.setenv("TRL_EXT_MEMORY_DIR", str(tmp_path / "blocked" / "shm"))
    trainer = _trainer(tmp_path / "run", tiny_model_path, memory_checkpoint_steps=1, save_steps=3, max_steps=3)
    with caplog.at_level(logging.WARNING, logger="trl_ext"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "memory_checkpoint_steps" in r.getMessage()]
    assert len(said) == 1 and "cannot be written" in said[0], said
    assert not trainer.checkpoints.memory_history
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-3"]


def _note(machines: int, world: int, *parts: int) -> dict:
    return {"machines": machines, "world": world, "parts": {p: [f"part-{p}.bin"] for p in parts}}


def test_the_machines_resume_the_newest_step_they_hold_together_and_move_what_each_lacks():
    """memory_replicas.plan: machine m holds its own part and machine m-1's (a ring)."""
    ring = [{12: _note(2, 2, 0, 1)}, {12: _note(2, 2, 1, 0)}]
    assert plan(ring, 0, 2) == Plan(12, 2, 2, ())  # both whole: nothing moves
    assert plan(ring, 12, 2).step is None  # the disk's is as new: it is resumed instead
    new_node = [{12: _note(2, 2, 0, 1), 10: _note(2, 2, 0, 1)}, {}]  # machine 1 recreated on a new node
    assert plan(new_node, 10, 2) == Plan(12, 2, 2, ((0, 1, 0), (0, 1, 1)))
    # three machines, the third lost, two left with 2 ranks each: every machine takes every part (resharding)
    three = [{12: _note(3, 3, 0, 2)}, {12: _note(3, 3, 1, 0)}]
    assert plan(three, 0, 4) == Plan(12, 3, 3, ((1, 0, 1), (0, 1, 2)))
    # two of three lost: machine 1's part is nowhere, and step 8 was taken on another number of machines
    alone = [{12: _note(3, 3, 0, 2), 8: _note(1, 1, 0)}]
    assert plan(alone, 0, 1) == Plan(8, 1, 1, ())
    assert plan([{12: _note(3, 3, 0, 2)}, {12: _note(2, 2, 1, 0)}], 0, 2).step is None  # notes that disagree
    assert "machine 1 received the parts of machines 0 and 1 from machine 0" == said(plan(new_node, 10, 2))
    # an elastic job grown from one machine to two: the new one receives the first's whole checkpoint
    grown = [{14: _note(1, 1, 0), 12: _note(2, 2, 0, 1)}, {}]
    assert plan(grown, 0, 2) == Plan(14, 1, 1, ((0, 1, 0),))
    assert said(plan(grown, 0, 2)) == "machine 1 received machine 0's part from machine 0"


def test_one_machine_never_resumes_a_memory_checkpoint_whose_other_parts_are_elsewhere(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    tier = MemoryTier(tmp_path / "shm" / "key", 2, str(out))
    tier.share_token(SimpleNamespace(output_dir=str(out)), create=True)
    tier.begin(None)
    checkpoint = tier.root / "checkpoint-12"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 12}))
    write_holds(checkpoint, 3, 3, {0: ["trainer_state.json"], 2: []})
    tier.committed(checkpoint, 12)
    path, line = tier.newest()
    assert path is None and line == (f"memory checkpoint {checkpoint} is not resumed: it was taken on 3 machines and "
                                     "holds the parts of machines 0, 2 only (machine 1's is elsewhere)"), line
