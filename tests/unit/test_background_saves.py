"""Background saves in one process: training goes on while a whole checkpoint (weights, optimizer, scheduler and RNG
states) is copied and written, every file is the foreground one, the next optimizer step waits for the copies (and,
without that wait, the checkpoint would be wrong), a checkpoint appears (and older ones are rotated out) only once
committed, a failure in any part stops training at the next step with the last good checkpoint kept, the copies are
allocated once (after the first step) or, where they do not fit, saves run in the foreground, save_only_model is
honoured, and every checkpoint's cost is logged. The multi-process cases are in
tests/distributed/test_background_saves.py."""

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
from tests.probes.copy_order import CopyOrder
from trl_ext.errors import CheckpointError
from trl_ext.files import shards
from trl_ext.files.audit import audit
from trl_ext.saving import deferred, pipeline
from trl_ext.saving.executor import BackgroundCheckpoint, Executor
from trl_ext.saving.snapshot import Snapshot

ROWS = [{"messages": [{"role": "user", "content": f"{i}+1?"}, {"role": "assistant", "content": f"{i + 1}"}]}
        for i in range(16)]


class StepEnds(TrainerCallback):
    """Records each step's end, and sets ``reached`` when step ``step`` ends; with ``after``, that step's end first
    waits for it (so the order of the two events is the same on a loaded machine as on an idle one)."""

    def __init__(self, step: int, events: list, after: threading.Event | None = None):
        self.step, self.events, self.reached, self.after = step, events, threading.Event(), after

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.after is not None:
            assert self.after.wait(60), f"step {self.step} ended, and nothing it waited for happened"
        self.events.append(("step_end", state.global_step))
        if state.global_step == self.step:
            self.reached.set()


def _trainer(out: Path, tiny_model_path, callbacks=(), **config):
    config = {"max_steps": 4, "save_steps": 1, **config}
    args = trl_ext.SFTConfig(output_dir=str(out), seed=0, per_device_train_batch_size=2, report_to="none", **config)
    return trl_ext.SFTTrainer(model=tiny_model_path, args=args, train_dataset=Dataset.from_list(ROWS),
                              callbacks=list(callbacks))


def _files(directory: Path) -> dict[str, str]:
    """Every file's digest, but training_args.bin (it records save_in_background itself)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())
            if p.is_file() and p.name != "training_args.bin"}


@pytest.fixture(scope="module")
def foreground(tmp_path_factory, tiny_model_path):
    out = tmp_path_factory.mktemp("foreground") / "run"
    _trainer(out, tiny_model_path).train()
    return out


def test_a_step_runs_while_a_checkpoint_is_written_and_the_checkpoints_equal_the_foregrounds(
        tmp_path, monkeypatch, tiny_model_path, foreground):
    """checkpoint-1's optimizer states start being written during step 2 and finish only once it has ended: the run
    completes only if training went on meanwhile (events, not timings; step 2's end waits for the write to start, which
    the executor's thread reaches after the weights, so that a loaded machine orders them as an idle one). Every file of
    every checkpoint is the foreground run's, byte for byte."""
    events, write_synced, writing = [], deferred.write_synced, threading.Event()
    steps = StepEnds(2, events, after=writing)

    def held_write(write, path):
        if "checkpoint-1" in path and Path(path).name == "optimizer.pt":
            events.append(("writing", 1))
            writing.set()
            assert steps.reached.wait(60), "no step ran while checkpoint-1's optimizer states were being written"
        return write_synced(write, path)

    monkeypatch.setattr(deferred, "write_synced", held_write)
    trainer = _trainer(tmp_path / "run", tiny_model_path, [steps], save_in_background=True)
    trainer.train()
    assert events.index(("writing", 1)) < events.index(("step_end", 2))
    executor = trainer.checkpoints.executor
    assert [(kind, name) for kind, name, _ in executor.events if kind in ("started", "finished")] == [
        (kind, f"checkpoint-{s}") for s in (1, 2, 3) for kind in ("started", "finished")]
    parts = [name for kind, name, _ in executor.events if kind == "wrote"]
    # TRL's model card (output_dir/README.md) with checkpoint-1's files, and never again: it does not change
    assert parts[:5] == ["README.md", "checkpoint-1", "optimizer.pt", "scheduler.pt", "rng_state.pth"], parts
    assert parts.count("README.md") == 1 and (tmp_path / "run" / "README.md").is_file(), parts
    # checkpoint-4 is the run's last: written in the foreground (nothing would run meanwhile)
    for step in (1, 2, 3, 4):
        name = f"checkpoint-{step}"
        assert _files(tmp_path / "run" / name) == _files(foreground / name), name
        assert audit(str(tmp_path / "run" / name)).ok
    assert not list((tmp_path / "run").glob(".*")), "a partial directory was left behind"
    model = trainer.model
    assert trainer.checkpoints.last.weight_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    costs = trainer.checkpoints.history
    assert len(costs) == 4 and not [h for h in trainer.state.log_history if "checkpoint/held_s" in h]
    for cost in costs:
        metrics = cost.metrics()  # what the loggers get
        assert metrics["checkpoint/held_s"] == pytest.approx(metrics["checkpoint/held_save_s"] + metrics[
            "checkpoint/held_copy_wait_s"] + metrics["checkpoint/held_previous_s"], abs=1e-3)
        assert cost.write_s > 0 and metrics["checkpoint/bytes"] == cost.bytes > 0
    committed = sum(f.stat().st_size for f in (tmp_path / "run" / "checkpoint-4").iterdir())
    assert costs[-1].bytes == committed


@pytest.mark.parametrize("guarded", [True, False])
def test_the_next_forward_and_backward_run_while_the_copies_are_made_and_the_optimizer_step_waits(
        tmp_path, tiny_model_path, foreground, guarded):
    """checkpoint-1's copies are held until step 2's backward has begun: step 2's forward and backward run while they
    are made, its optimizer step starts only after they end, and the checkpoint is the foreground's, byte for byte.
    Without the wait before the optimizer step (``guarded=False``: the copies then run after that step), the
    checkpoint holds step 2's values: the comparison above would fail, as it must."""
    trainer = _trainer(tmp_path / "run", tiny_model_path, save_in_background=True)
    order = CopyOrder(trainer, 1, guarded=guarded)
    trainer.add_callback(order)
    trainer.train()
    events = [(event, step) for event, step, _ in order.events]
    at = {event: events.index((event, step)) for event, step in [
        ("forward", 2), ("backward", 2), ("copies_started", 1), ("copies_done", 1), ("optimizer_step", 2)]}
    same = _files(tmp_path / "run" / "checkpoint-1") == _files(foreground / "checkpoint-1")
    if guarded:
        # when the copies' thread picks the copies up is the scheduler's choice (step 2's forward may come first); that
        # they end after step 2's backward began and before its optimizer step is not
        assert at["forward"] < at["backward"] < at["copies_done"] < at["optimizer_step"], events
        assert at["copies_started"] < at["copies_done"], events
        assert same
    else:
        assert at["optimizer_step"] < at["copies_done"], events
        differ = [n for n, d in _files(tmp_path / "run" / "checkpoint-1").items()
                  if d != _files(foreground / "checkpoint-1")[n]]
        assert not same and {"model.safetensors", "optimizer.pt"} <= set(differ), differ


@pytest.mark.parametrize("part", ["weights", "optimizer.pt"])
def test_a_failed_background_save_stops_training_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch,
                                                                                    tiny_model_path, part):
    """checkpoint-3's weights, or its optimizer states, fail to write (disk full) with save_total_limit=1: training
    stops at step 4 on the failure, and checkpoint-2 is kept (never rotated out for a checkpoint that did not
    commit), whole and resumable."""
    append, write_synced = shards.ShardStreamWriter.append, deferred.write_synced

    def full_disk(self, piece):
        if "checkpoint-3" in str(self.directory):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        append(self, piece)

    def full_disk_for_states(write, path):
        if "checkpoint-3" in path and Path(path).name == part:
            return write_synced(lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))),
                                path)
        return write_synced(write, path)

    if part == "weights":
        monkeypatch.setattr(shards.ShardStreamWriter, "append", full_disk)
    else:
        monkeypatch.setattr(deferred, "write_synced", full_disk_for_states)
    trainer = _trainer(tmp_path / "run", tiny_model_path, save_in_background=True, save_total_limit=1)
    with pytest.raises(CheckpointError, match=r"No space left on device.*earlier saves are intact"):
        trainer.train()
    assert trainer.state.global_step == 4  # reported at the next step boundary, or before checkpoint-4 at the latest
    out = tmp_path / "run"
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
    assert [p.name for p in out.iterdir() if p.name.startswith("checkpoint-")] == ["checkpoint-2"]
    assert audit(str(out / "checkpoint-2")).ok and (out / "checkpoint-2" / "optimizer.pt").is_file()


def test_the_copies_are_allocated_once_after_the_first_step(tmp_path, tiny_model_path):
    trainer = _trainer(tmp_path / "run", tiny_model_path, save_in_background=True, save_steps=2)
    allocated = []
    reserve = trainer.checkpoints.reserve

    def reserving():
        reserve()
        allocated.append(trainer.checkpoints.snapshot.allocated)

    trainer.checkpoints.reserve = reserving
    trainer.train()
    snapshot = trainer.checkpoints.snapshot
    assert allocated and allocated[0] > 0 and snapshot.allocated == allocated[0]  # nothing after the reserve
    assert allocated[0] == trainer.checkpoints.measured  # what the memory check counted is what was allocated
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    moments = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
                  if isinstance(t, torch.Tensor) and t.dim())
    assert allocated[0] >= moments  # the optimizer's states (and the scheduler and RNG states) are copied


def test_copies_that_do_not_fit_in_memory_leave_saves_in_the_foreground(tmp_path, tiny_model_path, monkeypatch,
                                                                       caplog, foreground):
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 1000})())
    trainer = _trainer(tmp_path / "run", tiny_model_path, save_in_background=True)
    with caplog.at_level("WARNING", logger="trl_ext"):
        trainer.train()
    said = [r.message for r in caplog.records if "save_in_background" in r.message]
    assert len(said) == 1 and "their CPU copies need" in said[0] and "0.00 GiB is available" in said[0], said
    checkpoints = trainer.checkpoints
    assert not checkpoints.executor.events and checkpoints.snapshot.allocated == 0  # all in the foreground
    for step in (1, 2, 3, 4):
        assert _files(tmp_path / "run" / f"checkpoint-{step}") == _files(foreground / f"checkpoint-{step}")


@pytest.mark.parametrize("in_background", [False, True])
def test_save_only_model_writes_the_weights_only(tmp_path, tiny_model_path, in_background):
    trainer = _trainer(tmp_path / "run", tiny_model_path, save_in_background=in_background, save_only_model=True)
    trainer.train()
    for step in (1, 2, 3, 4):
        names = sorted(p.name for p in (tmp_path / "run" / f"checkpoint-{step}").iterdir())
        assert "model.safetensors" in names and not [n for n in names if n.startswith(("optimizer", "scheduler",
                                                                                         "rng_state"))], names
    if in_background:  # the weights' copies only: no optimizer, scheduler or RNG states
        weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        assert trainer.checkpoints.snapshot.allocated == weights


def test_a_save_is_written_only_once_run_and_never_once_cancelled(tmp_path, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    executor, snapshot, done = Executor(), Snapshot(), []

    def save_to(name: str) -> BackgroundCheckpoint:
        snapshot.begin()
        save = BackgroundCheckpoint(tmp_path / name, executor, snapshot)
        pipeline.save(model, tmp_path / name, into=save)  # staged and queued, nothing written
        save.commits.append(lambda: done.append(name))
        return save

    save = save_to("held")
    (tmp_path / "held" / "optimizer.pt").write_bytes(b"written by the caller meanwhile")
    assert not executor.events and not (tmp_path / "held" / "model.safetensors").exists()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    snapshot.start()
    snapshot.wait_for_copies()
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # after the copies: not in the checkpoint
    executor.run(save)
    executor.join()
    assert save.error is None and done == ["held"] and audit(str(tmp_path / "held")).ok
    assert (tmp_path / "held" / "optimizer.pt").read_bytes() == b"written by the caller meanwhile"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "held").state_dict()
    assert all(torch.equal(reloaded[k], before[k]) for k in before)

    save = save_to("cancelled")
    save.cancelled = True  # training stopped before the save was whole
    snapshot.start()
    executor.run(save)
    executor.join()
    assert isinstance(save.error, CheckpointError) and "abandoned" in str(save.error) and done == ["held"]
    assert not (tmp_path / "cancelled" / "model.safetensors").exists()
    assert executor.close(timeout=10) and snapshot.close(timeout=10)


def test_the_copies_and_executor_threads_start_once_end_with_train_and_run_in_order(tmp_path, tiny_model_path,
                                                                                   monkeypatch):
    """The copies' and the executor's threads start at the end of the first step, once: no checkpoint waits for a new
    thread to start (on a busy CPU that wait held training for most of a background checkpoint's hold); they end
    when train() ends, and a later train() starts them again."""
    from trl_ext.saving.call_thread import CallThread

    calls, seen = CallThread("test-worker"), []
    results = [calls.submit(seen.append, i) for i in range(5)]
    assert [f.result(timeout=10) for f in results] == [None] * 5 and seen == list(range(5))
    reported = []
    with monkeypatch.context() as patched:
        patched.setattr(threading, "excepthook", reported.append)  # what a thread's uncaught error goes to
        failed = calls.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failed.result(timeout=10)
        assert calls.submit(lambda: None).result(timeout=10) is None  # the thread goes on after an error
    assert [type(r.exc_value) for r in reported] == [ZeroDivisionError] and reported[0].thread.name == "test-worker"
    thread = calls.submit(lambda: threading.current_thread()).result(timeout=10)
    assert thread.daemon  # a call stuck in a collective with a dead rank never holds the exit
    assert calls.close(timeout=10) and not thread.is_alive()
    assert calls.submit(lambda: threading.current_thread()).result(timeout=10) is not thread  # started again
    assert calls.close(timeout=10)

    started = []
    original = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self), original(self))[1])
    trainer = trl_ext.SFTTrainer(model=tiny_model_path, args=trl_ext.SFTConfig(
        output_dir=str(tmp_path), max_steps=6, save_steps=2, per_device_train_batch_size=2, report_to="none",
        save_in_background=True), train_dataset=Dataset.from_list([{"text": "1+1=2"}] * 16))
    for _ in range(2):  # a later train() starts them again
        started.clear()
        trainer.train()
        ours = [t for t in started if t.name.startswith("trl_ext-")]
        assert sorted(t.name for t in ours) == ["trl_ext-copies", "trl_ext-writes"], started
        assert not [t for t in ours if t.is_alive()], "the threads outlived train()"
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    started_saves = [name for kind, name, _ in trainer.checkpoints.executor.events if kind == "started"]
    assert started_saves == ["checkpoint-2", "checkpoint-4"] * 2, started_saves


def test_a_checkpoint_due_before_the_previous_write_ends_waits_and_says_so_once(tmp_path, tiny_model_path,
                                                                                monkeypatch, caplog):
    """Checkpoints due faster than the disk writes them: none is skipped, each waits for the previous write (logged as
    held_previous_s), and the first wait long enough to matter is said in one line, once, with what to set."""
    write_synced = deferred.write_synced

    def slow_disk(write, path):  # every checkpoint's optimizer state takes 0.8 s to write
        if Path(path).name == "optimizer.pt":
            threading.Event().wait(0.8)
        return write_synced(write, path)

    monkeypatch.setattr(deferred, "write_synced", slow_disk)
    trainer = _trainer(tmp_path / "run", tiny_model_path, save_in_background=True)
    with caplog.at_level("WARNING", logger="trl_ext"):
        trainer.train()
    out = tmp_path / "run"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [
        f"checkpoint-{n}" for n in range(1, 5)]  # none skipped
    waits = [cost.held_previous_s for cost in trainer.checkpoints.history]
    assert max(waits) >= 0.5, waits
    said = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(said) == 1 and "for the previous checkpoint's write to end" in said[0], said
    assert "set save_steps to at least twice a write's time" in said[0] and "\n" not in said[0]
