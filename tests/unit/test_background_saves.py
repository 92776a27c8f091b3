"""Background saves in one process: training goes on while a checkpoint is written, a checkpoint appears (and older
ones are rotated out) only once committed, and a failure stops training at the next step with the last good
checkpoint kept. The multi-process cases are in tests/distributed/test_background_saves.py."""

import errno
import hashlib
import os
import threading
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

import trl_ext
from trl_ext.errors import CheckpointError
from trl_ext.files import shards
from trl_ext.files.audit import audit
from trl_ext.saving import BackgroundSaves, pipeline

ROWS = [{"messages": [{"role": "user", "content": f"{i}+1?"}, {"role": "assistant", "content": f"{i + 1}"}]}
        for i in range(16)]


class StepEnds(TrainerCallback):
    """Records each step's end, and sets ``reached`` when step ``step`` ends."""

    def __init__(self, step: int, events: list):
        self.step, self.events, self.reached = step, events, threading.Event()

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step_end", state.global_step))
        if state.global_step == self.step:
            self.reached.set()


def _trainer(out: Path, tiny_model_path, callbacks=(), **config):
    args = trl_ext.SFTConfig(output_dir=str(out), max_steps=4, save_steps=1, seed=0, per_device_train_batch_size=2,
                             report_to="none", **config)
    return trl_ext.SFTTrainer(model=tiny_model_path, args=args, train_dataset=Dataset.from_list(ROWS),
                              callbacks=list(callbacks))


def _weights(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def foreground(tmp_path_factory, tiny_model_path):
    out = tmp_path_factory.mktemp("foreground") / "run"
    _trainer(out, tiny_model_path).train()
    return out


def test_a_step_runs_while_a_checkpoint_is_written_and_the_checkpoints_equal_the_foregrounds(
        tmp_path, monkeypatch, tiny_model_path, foreground):
    """checkpoint-1's writer is held until step 2 has ended: the run completes only if training went on meanwhile
    (events, not timings). Every checkpoint's weights equal the foreground run's, byte for byte."""
    events, finish = [], shards.ShardStreamWriter.finish
    steps = StepEnds(2, events)

    def held_finish(self):
        if "checkpoint-1" in str(self.directory):
            events.append(("writing", 1))
            assert steps.reached.wait(60), "no step ran while checkpoint-1 was being written"
        finish(self)

    monkeypatch.setattr(shards.ShardStreamWriter, "finish", held_finish)
    trainer = _trainer(tmp_path / "run", tiny_model_path, [steps], save_in_background=True)
    trainer.train()
    assert events.index(("writing", 1)) < events.index(("step_end", 2))
    saves = [(kind, Path(target).name) for kind, target, _ in trainer._background.events]
    assert saves == [("started", "checkpoint-1"), ("finished", "checkpoint-1"), ("started", "checkpoint-2"),
                     ("finished", "checkpoint-2"), ("started", "checkpoint-3"), ("finished", "checkpoint-3")]
    # checkpoint-4 is the run's last: written in the foreground (nothing would run meanwhile)
    for step in (1, 2, 3, 4):
        name = f"checkpoint-{step}"
        assert _weights(tmp_path / "run" / name) == _weights(foreground / name), name
        assert audit(str(tmp_path / "run" / name)).ok
    assert not list((tmp_path / "run").glob(".*")), "a staging directory was left behind"
    model = trainer.model
    assert trainer._background.snapshot_bytes == sum(p.numel() * p.element_size() for p in model.parameters())


def test_a_failed_background_save_stops_training_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch,
                                                                                    tiny_model_path):
    """checkpoint-3's writes fail (disk full) with save_total_limit=1: training stops at step 4 on the failure, and
    checkpoint-2 is kept (never rotated out for a checkpoint that did not commit), whole and resumable."""
    append = shards.ShardStreamWriter.append

    def full_disk(self, piece):
        if "checkpoint-3" in str(self.directory):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        append(self, piece)

    monkeypatch.setattr(shards.ShardStreamWriter, "append", full_disk)
    trainer = _trainer(tmp_path / "run", tiny_model_path, save_in_background=True, save_total_limit=1)
    with pytest.raises(CheckpointError, match=r"No space left on device.*earlier saves are intact"):
        trainer.train()
    assert trainer.state.global_step == 4  # reported at the next step boundary, or before checkpoint-4 at the latest
    out = tmp_path / "run"
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
    assert [p.name for p in out.iterdir() if p.name.startswith("checkpoint-")] == ["checkpoint-2"]
    assert audit(str(out / "checkpoint-2")).ok


def test_a_held_save_commits_only_once_released_and_never_after_abandon(tmp_path, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    saves, done = BackgroundSaves(), []
    pipeline.save(model, tmp_path / "held", background=saves, held=True)
    (tmp_path / "held" / "optimizer.pt").write_bytes(b"written by the caller meanwhile")
    saves._thread.join(0.5)
    assert saves._thread.is_alive() and not (tmp_path / "held" / "model.safetensors").exists()
    saves.release(lambda: done.append(True))
    saves.wait()
    assert done == [True] and audit(str(tmp_path / "held")).ok
    assert (tmp_path / "held" / "optimizer.pt").read_bytes() == b"written by the caller meanwhile"

    pipeline.save(model, tmp_path / "abandoned", background=saves, held=True)
    saves.abandon()
    assert not (tmp_path / "abandoned" / "model.safetensors").exists() and done == [True]

    pipeline.save(model, tmp_path / "plain", background=saves)  # not held: committed as soon as it is written
    saves.wait()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), model.state_dict().values()))
    saves.release(lambda: done.append("now"))  # nothing held: runs at once
    assert done == [True, "now"]
