"""A preempted job (SIGTERM or SIGUSR1, to every rank or to one) saves the checkpoint of the step it stopped at,
exits with 128 + the signal's number (the first rank to exit; the launcher ends the others), and resumes as if it
had never stopped.

Each case trains on 2 processes under ZeRO-3 (4 steps, a checkpoint every 2) with the same seed as the uninterrupted
run (the shared ``zero3_run``), is signalled, and is resumed with ``resume_from_checkpoint=True`` (the three resumes
in one launch); the resumed run
must end with the uninterrupted run's weights, optimizer states, scheduler and logged losses (as in
``test_reliability``). The launch's timeout is the hang detector.
"""

import json
import re

import pytest
from transformers.trainer_utils import get_last_checkpoint

from tests.distributed.test_reliability import TRAIN, assert_resumed_equals_uninterrupted, digest, train
from tests.harness import SCRIPTS, accelerate_launch, write_accelerate_config
from trl_ext.assets import default_model_path
from trl_ext.files.audit import audit

pytestmark = pytest.mark.slow

# name: trainer, training args, the signal, the checkpoint it must leave
CASES = {
    "sft-lora-every-rank-sigterm-mid-step": ("sft", ["--lora"], ["--signal_at_step", "3"], 3),
    "reward-lora-one-rank-sigusr1-mid-step": (
        "reward", ["--lora"], ["--signal_at_step", "3", "--signal_rank", "1", "--signal", "SIGUSR1"], 3),
    # rank 0: the tiny model is one file, which rank 0 writes
    "sft-full-one-rank-sigterm-mid-save": ("sft", [], ["--signal_during_save", "2", "--signal_rank", "0"], 2),
    # save_in_background: the signal comes while checkpoint-2 is still being written (its writer waits for step 3's
    # end); checkpoint-2 is committed, then checkpoint-3, in the foreground, before the exit
    "sft-full-every-rank-sigterm-while-a-background-save-is-in-flight": (
        "sft", ["--config_json", '{"save_in_background": true}'],
        ["--signal_at_step", "3", "--hold_save", "2", "3"], 3),
}


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """Each case signalled (one launch each), then all resumed in one launch (``run_many.py``)."""
    tmp = tmp_path_factory.mktemp("preemption")
    stopped, left = {}, {}
    for case, (trainer, args, signal_args, saved) in CASES.items():
        stopped[case] = train(tmp, trainer, case, *args, *signal_args)
        checkpoint = tmp / case / f"checkpoint-{saved}"  # what the stop left, before the resume adds to it
        left[case] = (get_last_checkpoint(str(tmp / case)), digest(checkpoint) if checkpoint.is_dir() else None,
                      audit(str(checkpoint), base=default_model_path()),
                      sorted(p.name for p in (tmp / case).glob("checkpoint-*")))
    argvs = [["--trainer", trainer, *args, *TRAIN, "--resume", "--output_dir", str(tmp / case)]
             for case, (trainer, args, _, _) in CASES.items()]
    config = write_accelerate_config(tmp / "configs", "zero3")
    resumed = accelerate_launch(SCRIPTS / "run_many.py", ["train.py", json.dumps(argvs)], config, timeout=400)
    return tmp, stopped, left, resumed


@pytest.mark.parametrize("case", CASES)
def test_preempted_job_saves_exits_and_resumes_as_uninterrupted(preempted, zero3_run, case):
    trainer, args, signal_args, saved = CASES[case]
    reference, _ = zero3_run(trainer, "--lora" in args)
    tmp, stopped, left, resumed = preempted
    stopped, out = stopped[case], tmp / case
    assert not stopped.timed_out, f"the job hung after the signal:\n{stopped.output[-4000:]}"
    name = "SIGUSR1" if "SIGUSR1" in signal_args else "SIGTERM"
    code = 138 if name == "SIGUSR1" else 143
    assert f"{name} received: saved {out}/checkpoint-{saved} (step {saved}) and stopped, exit code {code}" in \
        stopped.output, stopped.output[-4000:]
    # The first rank to exit exits with the code; torchrun then sends SIGTERM to the other, which has either exited
    # with the code already or is finishing its exit (-15 when it arrives after Python has given up its handlers).
    codes = re.findall(r"exitcode\s*: (-?\d+)", stopped.output)
    root_cause = stopped.output.split("Root Cause")[-1]
    assert re.search(rf"exitcode\s*: {code}\b", root_cause), stopped.output[-4000:]
    assert codes and set(codes) <= {str(code), "-15"}, stopped.output[-4000:]
    assert stopped.returncode == 1  # torchrun's own code for a failed worker: it does not pass the worker's on
    last, before, report, committed = left[case]
    assert last == str(out / f"checkpoint-{saved}")
    assert report.ok, report.format()
    if "--hold_save" in signal_args:  # the save in flight was completed, not lost
        assert committed == ["checkpoint-2", "checkpoint-3"], committed

    assert resumed.returncode == 0, resumed.output[-6000:]
    assert digest(out / f"checkpoint-{saved}") == before
    assert_resumed_equals_uninterrupted(reference, out, case, steps_run_here=4 - saved)
