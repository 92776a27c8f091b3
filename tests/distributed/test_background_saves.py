"""Background saves under 2-process ZeRO-3 (``save_in_background``): training runs while a checkpoint is written,
each rank copies only its own part, a ``kill -9`` mid-save costs nothing already committed, and runs with several
background checkpoints resume exactly.

Three launches of ``train.py`` (4 steps, as the uninterrupted ``zero3_run`` of the same seed, but a checkpoint every
step: 1-3 in the background, 4, the last, in the foreground):
- held: checkpoint-2's writer waits until step 3 has ended (``--hold_save 2 3``): if training waited for the save,
  the save would fail after 120 s;
- killed: every rank is SIGKILLed while checkpoint-3 is written in the background;
- resumed (one launch, ``run_many.py``): the killed run with ``resume_from_checkpoint=True``, and the held run's
  checkpoint-3 resumed into a fresh directory.
Each resume must end with the uninterrupted run's weights, optimizer states, scheduler and logged losses.
The multi-process writing of background checkpoints (4 ranks, ZeRO-3 and FSDP2) is in ``test_parallel_writes``;
a preemption while a background save is in flight in ``test_preemption``; the one-process cases in
``tests/unit/test_background_saves.py``.
"""

import json

import pytest
from transformers.trainer_utils import get_last_checkpoint

from tests.distributed.test_reliability import assert_resumed_equals_uninterrupted, digest
from tests.harness import SCRIPTS, accelerate_launch, write_accelerate_config
from trl_ext.assets import default_model_path
from trl_ext.files.audit import audit
from trl_ext.files.commit import PARTIAL_SUFFIX

pytestmark = pytest.mark.slow

BACKGROUND = ["--trainer", "sft", "--max_steps", "4", "--save_steps", "1", "--config_json",
              json.dumps({"save_in_background": True})]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("background")
    config = write_accelerate_config(tmp / "configs", "zero3")

    def launch(script, args, timeout=300):
        return accelerate_launch(SCRIPTS / script, args, config, timeout=timeout)

    held = launch("train.py", [*BACKGROUND, "--hold_save", "2", "3", "--output_dir", str(tmp / "held")])
    assert held.returncode == 0, held.output[-6000:]
    killed = launch("train.py", [*BACKGROUND, "--kill_during_save", "3", "--output_dir", str(tmp / "killed")])
    left = (get_last_checkpoint(str(tmp / "killed")), sorted(p.name for p in (tmp / "killed").iterdir()),
            digest(tmp / "killed" / "checkpoint-2"))
    argvs = [[*BACKGROUND, "--resume", "--output_dir", str(tmp / "killed")],
             [*BACKGROUND, "--resume_from", str(tmp / "held" / "checkpoint-3"), "--output_dir", str(tmp / "from3")]]
    resumed = launch("run_many.py", ["train.py", json.dumps(argvs)], timeout=400)
    return tmp, killed, left, resumed


def _saves(out, rank):
    return json.loads((out / f"saves_rank{rank}.json").read_text())


def test_a_step_runs_while_a_checkpoint_is_written_and_each_rank_copies_only_its_own_part(runs, zero3_run):
    tmp, *_ = runs
    reference, _ = zero3_run("sft", False)
    out = tmp / "held"
    writer = _saves(out, 0)  # the tiny model is one file: rank 0 writes it
    (_, _, waits), = [e for e in writer["held"] if e[0] == "writer_waits"]
    step3 = next(t for kind, step, t in writer["held"] if kind == "step_end" and step == 3)
    started, finished = (next(t for kind, name, t in writer["events"] if kind == k and name == "checkpoint-2")
                         for k in ("started", "finished"))
    assert started < waits < step3 < finished, writer  # step 3 ran while checkpoint-2 was being written
    assert [(k, n) for k, n, _ in writer["events"]] == [
        (k, f"checkpoint-{s}") for s in (1, 2, 3) for k in ("started", "finished")]
    for rank in (0, 1):  # each rank's CPU copy is its own ZeRO-3 partition of the weights, nothing more
        saves = _saves(out, rank)
        assert saves["snapshot_bytes"] == saves["own_bytes"] > 0, saves
    for name in ("checkpoint-2", "checkpoint-4"):  # byte for byte the foreground saves of the same run
        weights = [n for n in digest(reference / name) if n.endswith(".safetensors")]
        assert weights and all(digest(out / name)[n] == digest(reference / name)[n] for n in weights), name
    for step in (1, 2, 3, 4):
        report = audit(str(out / f"checkpoint-{step}"), base=default_model_path())
        assert report.ok, report.format()
    assert not list(out.glob(".*")), "a staging directory was left behind"


def test_kill_9_during_a_background_save_keeps_the_previous_checkpoint(runs, zero3_run):
    tmp, killed, (last, names, before), _ = runs
    reference, _ = zero3_run("sft", False)
    out = tmp / "killed"
    assert not killed.timed_out and killed.returncode != 0, killed.output[-4000:]
    assert last == str(out / "checkpoint-2") and "checkpoint-3" not in names, names
    assert f".checkpoint-3{PARTIAL_SUFFIX}" in names  # the kill really hit checkpoint-3's save
    weights = [n for n in digest(reference / "checkpoint-2") if n.endswith(".safetensors")]
    assert all(before[n] == digest(reference / "checkpoint-2")[n] for n in weights)
    report = audit(str(out / "checkpoint-2"), base=default_model_path())
    assert report.ok, report.format()


@pytest.mark.parametrize("case", ["killed", "from3"])
def test_resume_from_a_background_checkpoint_equals_the_uninterrupted_run(runs, zero3_run, case):
    tmp, _, (_, _, before), resumed = runs
    reference, _ = zero3_run("sft", False)
    assert resumed.returncode == 0, resumed.output[-6000:]
    out = tmp / case
    if case == "killed":
        assert digest(out / "checkpoint-2") == before, "resuming changed the checkpoint it resumed from"
        assert not list(out.glob(".*")), "a staging directory from the interrupted save was left behind"
    assert_resumed_equals_uninterrupted(reference, out, case, steps_run_here={"killed": 2, "from3": 1}[case])
