"""Whole checkpoints in the background (``save_in_background``) under 2-process ZeRO-2, ZeRO-3 and FSDP2, full
fine-tuning with AdamW: the next step's forward and backward run while checkpoint-N's parts are copied and its
optimizer step only after the copies end; training runs while checkpoint-N's weights and optimizer states are written;
every background checkpoint is the foreground one (byte for byte; DCP's ``.metadata`` by what it loads), and would not
be without the wait before the optimizer step; ZeRO-2's weights are copied once; a ``kill -9`` of every rank mid-save
costs nothing already committed; resuming from a background checkpoint equals the uninterrupted run; DeepSpeed's own
tools read a background checkpoint as they read a foreground one.

One launch of ``train.py`` per engine of its own (4 steps; the background runs save every step, 1-3 in the
background and 4, the last, in the foreground): the held run (checkpoint-1's writers wait until step 2 has ended:
``--hold_save 1 2``; checkpoint-2's copies until step 3's backward has begun: ``--slow_copy 2``; if training waited for
either, it would fail after 120 s), the unguarded run (checkpoint-2's copies made after step 3, whose wait for them is
removed: ``--unguarded_copy 2``), then the killed run (every rank SIGKILLed while checkpoint-3's optimizer states are
written in the background), which ends the launch. The two
resumes (the killed run with ``resume_from_checkpoint=True``, the held run's checkpoint-2 into a fresh directory) join
the engine's shared launch, whose full SFT run (checkpoints 2 and 4 in the foreground) is the reference.
The multi-process writing of background checkpoints (4 ranks, ZeRO-3 and FSDP2) is in ``test_parallel_writes``; a
preemption while a background save is in flight in ``test_preemption``; the one-process cases in
``tests/unit/test_background_saves.py``.
"""

import json

import pytest
import torch
from transformers.trainer_utils import get_last_checkpoint

from tests.distributed.conftest import ENGINE_CASES, ZERO3_CASES, engine_args
from tests.distributed.test_reliability import assert_resumed_equals_uninterrupted, digest
from tests.harness import SCRIPTS, accelerate_launch, write_accelerate_config
from trl_ext.assets import default_model_path
from trl_ext.files.audit import audit
from trl_ext.files.commit import PARTIAL_SUFFIX

pytestmark = pytest.mark.slow

ENGINES = ["zero2", "zero3", "fsdp2"]
BACKGROUND = ["--trainer", "sft", "--max_steps", "4", "--save_steps", "1", "--config_json",
              json.dumps({"save_in_background": True})]
OPTIMIZER_FILES = {"zero2": "optim_states.pt", "zero3": "optim_states.pt", "fsdp2": "optimizer_0/"}


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory, shared_runs):
    """``engine_runs(engine)``: the directory of that engine's runs, its reference, the killed run's launch and what
    the kill left (made once per engine)."""
    made = {}

    def runs(engine: str):
        if engine in made:
            return made[engine]
        tmp = tmp_path_factory.mktemp(f"background-{engine}")
        config = write_accelerate_config(tmp / "configs", engine)
        background = [*BACKGROUND, "--batch", "2", "--grad_accum", "1"] if engine != "zero3" else BACKGROUND
        held_and_killed = [
            [*background, "--hold_save", "1", "2", "--slow_copy", "2", "--output_dir", str(tmp / "held")],
            [*background, "--unguarded_copy", "2", "--output_dir", str(tmp / "unguarded")],
            [*background, "--kill_during_states_save", "3", "--output_dir", str(tmp / "killed")]]
        killed = accelerate_launch(SCRIPTS / "run_many.py", ["train.py", json.dumps(held_and_killed)], config,
                                   timeout=600)
        left = (get_last_checkpoint(str(tmp / "killed")), sorted(p.name for p in (tmp / "killed").iterdir()),
                digest(tmp / "killed" / "checkpoint-2"))
        resumes = [[*background, "--resume", "--output_dir", str(tmp / "killed")],
                   [*background, "--resume_from", str(tmp / "held" / "checkpoint-2"), "--output_dir",
                    str(tmp / "from2")]]
        shared = [engine_args(engine, *case) for case in (ENGINE_CASES if engine != "zero3" else ZERO3_CASES)]
        shared_runs.many("train.py", engine, [*shared, *resumes], timeout=900)
        reference = shared_runs.get("train.py", engine, engine_args(engine, "sft", False))
        for resumed in resumes:
            shared_runs.get("train.py", engine, resumed)  # made by the launch above (or now, on its own)
        made[engine] = tmp, reference, killed, left
        return made[engine]

    return runs


def _saves(out, rank):
    return json.loads((out / f"saves_rank{rank}.json").read_text())


@pytest.mark.parametrize("engine", ENGINES)
def test_a_step_runs_while_a_checkpoints_weights_and_optimizer_states_are_written(engine_runs, engine):
    tmp, *_ = engine_runs(engine)
    out = tmp / "held"
    assert any(e[0].endswith("_waits") for rank in (0, 1) for e in _saves(out, rank)["held"])  # a writer was held
    for rank in (0, 1):
        saves = _saves(out, rank)
        step2 = next(t for kind, step, t in saves["held"] if kind == "step_end" and step == 2)
        events = saves["events"]
        first, last = (next(i for i, (kind, name, _) in enumerate(events) if kind == k and name == "checkpoint-1")
                       for k in ("started", "finished"))
        states = [t for kind, name, t in events[first:last] if kind == "wrote" and "optim" in name]
        assert states and events[first][2] < step2 < states[0] <= events[last][2], saves  # step 2 ran meanwhile
        assert [(k, n) for k, n, _ in events if k in ("started", "finished")] == [
            (k, f"checkpoint-{s}") for s in (1, 2, 3) for k in ("started", "finished")]
        # each rank's CPU copy of the weights is its own part (ZeRO-3, FSDP2), or the whole model on the writer
        # (ZeRO-2's whole parameters); every copy was allocated by the first step's reserve
        own = saves["own_bytes"] if engine != "zero2" else saves["own_bytes"] if rank == 0 else 0
        assert saves["weight_bytes"] == own, saves
        assert saves["allocated"] == saves["allocated_at_reserve"] == saves["measured"] > 0, saves
        costs = saves["costs"]  # every checkpoint's cost, the slowest rank's (the same on every rank)
        assert len(costs) == 4 and costs == _saves(out, 1 - rank)["costs"], costs
        assert all(c["checkpoint/write_s"] > 0 and c["checkpoint/bytes"] > 0 for c in costs), costs


@pytest.mark.parametrize("engine", ENGINES)
def test_the_next_forward_and_backward_run_while_the_copies_are_made_and_the_optimizer_step_waits(engine_runs,
                                                                                                    engine):
    tmp, reference, *_ = engine_runs(engine)
    for rank in (0, 1):
        order = [(event, step) for event, step, _ in _saves(tmp / "held", rank)["copy_order"]]
        at = {event: order.index((event, step)) for event, step in [
            ("copies_started", 2), ("forward", 3), ("backward", 3), ("copies_done", 2), ("optimizer_step", 3)]}
        # the copies' thread may pick them up after step 3's forward began (the scheduler's choice); they end after its
        # backward began and before its optimizer step
        assert at["forward"] < at["backward"] < at["copies_done"] < at["optimizer_step"], order
        assert at["copies_started"] < at["copies_done"], order
    # checkpoint-2 of the held run is the foreground's (test_background_checkpoints_are_the_foreground_ones); without
    # the wait, the copies hold step 3's values: the same comparison fails
    for rank in (0, 1):
        order = [(event, step) for event, step, _ in _saves(tmp / "unguarded", rank)["copy_order"]]
        assert order.index(("step_end", 3)) < order.index(("copies_done", 2)), order
    want, got = digest(reference / "checkpoint-2"), digest(tmp / "unguarded" / "checkpoint-2")
    differ = sorted(f for f in want if want[f] != got.get(f))
    assert any(OPTIMIZER_FILES[engine] in f for f in differ) and any("safetensors" in f for f in differ), differ


def test_zero2_copies_its_weights_once(engine_runs):
    """The writer's weights (its safetensors) and DeepSpeed's model states (the same flat 16-bit buffers) share one
    copy: rank 0, which writes both, holds one model more than rank 1 (which writes neither), not two."""
    tmp, *_ = engine_runs("zero2")
    ranks = [_saves(tmp / "held", r) for r in (0, 1)]
    weights = ranks[0]["own_bytes"]
    assert weights <= ranks[0]["allocated"] - ranks[1]["allocated"] < 1.5 * weights, ranks


@pytest.mark.parametrize("engine", ENGINES)
def test_background_checkpoints_are_the_foreground_ones(engine_runs, engine):
    tmp, reference, *_ = engine_runs(engine)
    out = tmp / "held"
    for name in ("checkpoint-2", "checkpoint-4"):
        want, got = digest(reference / name), digest(out / name)
        assert set(want) == set(got), (name, sorted(set(want) ^ set(got)))
        differ = sorted(f for f in want if want[f] != got[f])
        # training_args.bin records save_in_background and save_steps, trainer_state.json save_steps; DCP's .metadata
        # its writer's path and a random id
        assert set(differ) <= {"training_args.bin", "trainer_state.json", "optimizer_0/.metadata"}, (name, differ)
        states = [json.loads((d / name / "trainer_state.json").read_text()) for d in (reference, out)]
        assert [{k: v for k, v in state.items() if k != "save_steps"} for state in states] == \
            [{k: v for k, v in states[0].items() if k != "save_steps"}] * 2
        assert any(OPTIMIZER_FILES[engine] in f for f in want), sorted(want)
        if engine == "fsdp2":
            assert _dcp_tensors(reference / name / "optimizer_0") == _dcp_tensors(out / name / "optimizer_0")
    for step in (1, 2, 3, 4):
        report = audit(str(out / f"checkpoint-{step}"), base=default_model_path())
        assert report.ok, report.format()
    assert not list(out.glob(".*")), "a partial directory was left behind"


def _dcp_tensors(directory) -> dict:
    """What DCP loads from a directory, each tensor as bytes (comparable with ==)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(directory), f"{tmp}/whole.pt")
        whole = torch.load(f"{tmp}/whole.pt", weights_only=False)

    def flat(obj, prefix=""):
        if isinstance(obj, dict):
            return {k: v for key, value in obj.items() for k, v in flat(value, f"{prefix}{key}.").items()}
        if isinstance(obj, (list, tuple)):
            return {k: v for i, value in enumerate(obj) for k, v in flat(value, f"{prefix}{i}.").items()}
        return {prefix: obj.numpy().tobytes() if isinstance(obj, torch.Tensor) else obj}

    return flat(whole)


@pytest.mark.parametrize("engine", ENGINES)
def test_kill_9_while_the_optimizer_states_are_written_keeps_the_previous_checkpoint(engine_runs, engine):
    tmp, reference, killed, (last, names, before) = engine_runs(engine)
    out = tmp / "killed"
    assert not killed.timed_out and killed.returncode != 0, killed.output[-4000:]
    assert last == str(out / "checkpoint-2") and "checkpoint-3" not in names, names
    assert f".checkpoint-3{PARTIAL_SUFFIX}" in names  # the kill really hit checkpoint-3's save
    report = audit(str(out / "checkpoint-2"), base=default_model_path())
    assert report.ok, report.format()


@pytest.mark.parametrize("case", ["killed", "from2"])
@pytest.mark.parametrize("engine", ENGINES)
def test_resume_from_a_background_checkpoint_equals_the_uninterrupted_run(engine_runs, engine, case):
    tmp, reference, _, (_, _, before) = engine_runs(engine)
    out = tmp / case
    if case == "killed":
        assert digest(out / "checkpoint-2") == before, "resuming changed the checkpoint it resumed from"
        assert not list(out.glob(".*")), "a partial directory from the interrupted save was left behind"
    assert_resumed_equals_uninterrupted(reference, out, f"{engine}-{case}", steps_run_here=2)


@pytest.mark.parametrize("engine", ["zero2", "zero3"])
def test_deepspeeds_tools_read_a_background_checkpoint_as_a_foreground_one(engine_runs, engine):
    """zero_to_fp32 (and, for ZeRO-3, the universal-checkpoint conversion) give the same weights from both."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tmp, reference, *_ = engine_runs(engine)
    fp32 = [get_fp32_state_dict_from_zero_checkpoint(str(d / "checkpoint-2")) for d in (reference, tmp / "held")]
    assert fp32[0].keys() == fp32[1].keys() and all(torch.equal(fp32[0][k], fp32[1][k]) for k in fp32[0])
    if engine == "zero3":  # converted in copies: the reference is the suite's shared run, read only
        import shutil

        from trl_ext.resuming.universal import convert_to_universal

        copies = [tmp / f"universal-{i}" for i in range(2)]
        for source, copy in zip((reference, tmp / "held"), copies):
            shutil.copytree(source / "checkpoint-2", copy)
            convert_to_universal(copy, "global_step2")
        universal = [digest(copy / "global_step2_universal") for copy in copies]
        assert universal[0] == universal[1]
