"""Slurm's rules in one process (the real cluster runs are in tests/slurm): how a rank's end is told apart (a lost peer
or its own error), what each node's launcher then reports, whether the job requeues itself (the limit of failures in
a row without a new checkpoint), and when the time-limit warning is acted on (the time left against what a stop needs,
measured)."""

import json
import signal
import sys
from types import SimpleNamespace

import pytest
from transformers import TrainerControl

from trl_ext.launching import node, restart
from trl_ext.placement import outcome, ownership
from trl_ext.settings import environment
from trl_ext.trainers import deadline, preemption

JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n[1-2]"}


@pytest.fixture
def in_job(monkeypatch, tmp_path):
    """This process as one of job 4242's ranks on its first node, first run, with a run directory."""
    for key in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_RESTART_COUNT", environment.MAX_FAILURES.name,
                *environment.MAX_FAILURES.former):
        monkeypatch.delenv(key, raising=False)
    for key, value in JOB.items():
        monkeypatch.setenv(key, value)
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv(ownership.RUN_ENV, str(run))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # what outcome.watch() installs is this test's only
    monkeypatch.setattr(outcome, "_watching", [False, None])
    return run


# ------------------------------------------------------------------------------------------------ how a rank ended
@pytest.mark.parametrize("exc, kind", [
    (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:39314"), outcome.PEER),
    (RuntimeError("NCCL error: remote process exited or there was a network error"), outcome.PEER),
    (type("DistNetworkError", (RuntimeError,), {})("rendezvous: timed out"), outcome.PEER),
    (ValueError("a bug at step 20"), outcome.ERROR),
    (OSError(28, "No space left on device"), outcome.ERROR),
])
def test_a_lost_peer_is_told_from_an_error_by_the_exception(exc, kind):
    assert outcome.kind_of(exc) == kind


def test_a_wrapped_peer_loss_is_still_a_peer_loss():
    try:
        try:
            raise RuntimeError("Connection reset by peer")
        except RuntimeError as inner:
            raise KeyError("while saving") from inner
    except KeyError as outer:
        assert outcome.kind_of(outer) == outcome.PEER


def test_a_node_reports_its_ranks_ending_in_one_line_with_the_code_the_script_decides_on(in_job):
    assert node.ending(str(in_job), 0) == (0, None)  # finished: the recipe says so itself
    outcome.stopped("SIGUSR1", 40, "out/checkpoint-40", in_job)
    code, line = node.ending(str(in_job), 0)  # the ranks end quietly with 0 after a planned stop
    assert code == 138 and "stopped on the time-limit warning, with checkpoint-40 saved (exit 138)" in line
    for path in in_job.glob("stopped-*"):
        path.unlink()
    outcome.record(RuntimeError("Connection closed by peer"), in_job)
    assert node.ending(str(in_job), 1)[0] == restart.LOST
    (in_job / "failed-1.json").write_text(json.dumps({"kind": "error", "error": "ValueError: boom", "rank": "3"}))
    code, line = node.ending(str(in_job), 1)  # one rank's own error outweighs its peers' lost connections
    assert code == restart.ERROR and "rank 3 failed: ValueError: boom" in line


def test_a_rank_killed_without_a_word_is_reported_as_killed(in_job):
    assert node.ending(str(in_job), -signal.SIGKILL)[0] == restart.KILLED


# ------------------------------------------------------------------------------------------------ requeue or not
def _trained_into(in_job, out, steps):
    """A run that trained into ``out`` (claimed for the job, with checkpoints at ``steps``)."""
    ownership.claim(out)
    for step in steps:
        (out / f"checkpoint-{step}").mkdir(exist_ok=True)
    assert ownership.announced_output_dir(in_job) == str(out)


def test_a_bug_fails_once_and_a_planned_stop_is_not_a_failure(in_job):
    assert restart.decide(0).action == restart.FINISHED
    assert restart.decide(restart.ERROR, run_dir=str(in_job)).action == restart.FAILED
    assert restart.decide(1, run_dir=str(in_job)).action == restart.FAILED  # nothing says a node was lost
    outcome.record(ValueError("a bug"), in_job)  # this node's rank raised it; srun's code is a terminated peer's
    assert restart.decide(restart.KILLED, run_dir=str(in_job)).action == restart.FAILED
    warned = restart.decide(restart.WARNED)
    assert warned.action == restart.REQUEUE and warned.exit_code == 138
    assert restart.decide(restart.TERMINATED, terminated=True).action == restart.STOPPED
    outcome.stopped("SIGUSR1", 7, "out/checkpoint-7", in_job)  # srun's 143 is a node terminated after another's 138
    assert restart.decide(restart.TERMINATED, run_dir=str(in_job)).action == restart.REQUEUE


def test_a_sigterm_for_the_step_alone_requeues_and_one_for_the_job_stops(in_job, tmp_path):
    # A node that comes back delivers the SIGTERM slurmctld held for the job's lost run to its next run's step: the
    # batch script gets none, as it does for `scontrol requeue`, preemption, `scancel` and the time limit.
    _trained_into(in_job, tmp_path / "out", [20])
    outcome.stopped("SIGTERM", 41, "out/checkpoint-41", in_job)
    late = restart.decide(restart.TERMINATED, run_dir=str(in_job))
    assert late.action == restart.REQUEUE and late.exit_code == restart.TERMINATED
    assert "stopped on a SIGTERM for the step alone" in late.line and "failure 1 of 3" in late.line
    assert restart.decide(restart.TERMINATED, terminated=True, run_dir=str(in_job)).action == restart.STOPPED


def test_a_lost_node_requeues_until_the_limit_of_failures_without_a_new_checkpoint(in_job, tmp_path):
    out = tmp_path / "out"
    _trained_into(in_job, out, [20])
    decisions = [restart.decide(restart.LOST, run_dir=str(in_job), limit=2) for _ in range(3)]
    assert [d.action for d in decisions] == [restart.REQUEUE, restart.REQUEUE, restart.FAILED]
    assert "failure 2 of 2 in a row without a new checkpoint; newest checkpoint-20" in decisions[1].line
    assert "3 failures in a row without a new checkpoint (the limit is 2" in decisions[2].line
    (out / "checkpoint-40").mkdir()  # progress: the count starts again
    again = restart.decide(restart.KILLED, run_dir=str(in_job), limit=2)
    assert again.action == restart.REQUEUE and "failure 1 of 2" in again.line
    assert ownership.record(out)["failures"] == 1 and ownership.record(out)["checkpoint"] == 40


def test_a_node_slurm_shows_down_makes_an_unexplained_failure_a_lost_node(in_job, tmp_path):
    _trained_into(in_job, tmp_path / "out", [])
    decision = restart.decide(1, run_dir=str(in_job), unwell=["n2"])
    assert decision.action == restart.REQUEUE and "node(s) n2 stopped responding" in decision.line


@pytest.mark.parametrize("name", [environment.MAX_FAILURES.name, "TRL_EXT_SLURM_MAX_FAILURES"])
def test_the_limit_is_the_users(in_job, monkeypatch, tmp_path, name):
    _trained_into(in_job, tmp_path / "out", [])
    monkeypatch.setenv(name, "0")  # the one setting, or its former Slurm name
    decision = restart.decide(restart.LOST, run_dir=str(in_job))
    assert decision.action == restart.FAILED and f"the limit is 0, {name}" in decision.line


def test_a_run_that_failed_before_choosing_its_directory_counts_its_restarts(in_job, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")  # no output_dir announced: restarts + 1 stand in for the count
    assert restart.decide(restart.LOST, run_dir=str(in_job), limit=3).action == restart.FAILED


def test_the_record_belongs_to_its_job_only(in_job, tmp_path, monkeypatch):
    out = tmp_path / "out"
    ownership.claim(out)
    ownership.update(out, failures=1)
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    ownership.update(out, failures=7)  # another job's run cannot change it
    assert ownership.record(out) == {"run": "slurm-4242", "attempts": 1, "failures": 1} and not ownership.is_own(out)
    assert ownership.newest_checkpoint(out) == 0 and ownership.newest_checkpoint(tmp_path / "missing") == 0


# ------------------------------------------------------------------------------------------------ the warning
@pytest.mark.parametrize("text, seconds", [("4:05", 245), ("1:02:03", 3723), ("2-00:00:10", 172810), ("0:00", 0),
                                           ("UNLIMITED", None), ("NOT_SET", None), ("", None)])
def test_squeues_time_left_is_read(text, seconds):
    assert deadline.parse_time_left(text) == seconds


def test_a_stop_starts_when_the_time_left_comes_down_to_what_it_needs():
    budget = deadline.Budget()
    assert budget.must_stop(10_000)  # nothing measured yet: at once
    budget.step(2.0)
    budget.save(20.0)
    assert budget.need == 22.0 and budget.threshold() == 22.0 * deadline.SAFETY + deadline.MARGIN_SECONDS
    assert not budget.must_stop(budget.threshold() + 1) and budget.must_stop(budget.threshold())
    assert budget.must_stop(None)  # Slurm cannot say: at once
    assert deadline.Budget(save_seconds=5.0, step_seconds=1.0).need == 6.0  # an earlier run's, from the record


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_a_warned_run_trains_on_until_its_checkpoint_must_start(in_job, monkeypatch, tmp_path):
    clock, asked, limit = _Clock(), [], 1314.0  # the time limit, on the same clock
    monkeypatch.setattr(preemption.deadline, "time_left", lambda job_id: asked.append(job_id) or limit - clock.now)
    callback = preemption.Preemption()
    callback._clock = clock
    args = SimpleNamespace(device="cpu", output_dir=str(tmp_path / "out"), process_index=0)
    state, control = SimpleNamespace(global_step=0, max_steps=1000), TrainerControl()
    callback.on_train_begin(args, state, control)
    try:
        for _ in range(3):  # steps of 1 s and a checkpoint of 10 s, measured
            clock.now += 1.0
            state.global_step += 1
            callback.on_step_end(args, state, control)
        clock.now += 10.0
        callback.on_save(args, state, control)
        assert callback.budget.need == 11.0 and not control.should_training_stop
        callback._record(signal.SIGUSR1, None)  # warned with 301 s left: 11 s * 1.5 + 30 s are needed
        while not control.should_training_stop and state.global_step < state.max_steps:
            clock.now += 1.0
            state.global_step += 1
            callback.on_step_end(args, state, control)
        left = limit - clock.now
        assert callback.budget.threshold() - 1.0 < left <= callback.budget.threshold()  # not a step too early or late
        assert state.global_step > 250 and control.should_save and callback.stopping == signal.SIGUSR1
        first_ask = 1014.0  # the first step boundary after the warning; then every few seconds
        assert len(asked) == int((clock.now - first_ask) // preemption.REASK_SECONDS) + 1
    finally:
        callback.restore()


def test_a_warning_in_the_last_step_changes_nothing_and_sigterm_always_stops(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    callback = preemption.Preemption()
    args = SimpleNamespace(device="cpu", output_dir=str(tmp_path), process_index=0)
    state = SimpleNamespace(global_step=10, max_steps=10)
    callback.received = signal.SIGUSR1
    assert callback._decide(args, state) == 0
    callback.received = signal.SIGTERM
    assert callback._decide(args, state) == signal.SIGTERM
    state.global_step = 3
    callback.received = signal.SIGUSR1  # outside Slurm nothing says how much time is left: stop now
    assert callback._decide(args, state) == signal.SIGUSR1


def test_on_a_slurm_node_a_planned_stop_ends_quietly_and_leaves_what_it_saved(in_job, tmp_path):
    callback = preemption.Preemption()
    callback.stopping = signal.SIGTERM
    args = SimpleNamespace(device="cpu", output_dir=str(tmp_path / "out"), process_index=0)
    with pytest.raises(SystemExit) as exited:
        callback._exit(args, SimpleNamespace(global_step=7, max_steps=10))
    assert exited.value.code == 0  # its node's launcher reports the stop, with 143
    assert outcome.stops(in_job)[0]["signal"] == "SIGTERM" and outcome.stops(in_job)[0]["step"] == 7


def test_the_node_launcher_keeps_torchruns_own_log_to_the_critical_unless_the_user_set_it(in_job, tmp_path,
                                                                                          monkeypatch):
    # another node's torchrun agent can log a harmless traceback when the first node's leaves the exit barrier first
    script, seen = tmp_path / "recipe.py", tmp_path / "seen"
    script.write_text("import os, sys\nopen(sys.argv[1], 'w').write(os.environ.get('LOGLEVEL', ''))\n")
    monkeypatch.setenv("SLURM_NODEID", "1")  # not the first node: its run directory is its own to remove
    handlers = {signum: signal.getsignal(signum) for signum in (*node.RECORDED, node.WARNING)}
    try:
        monkeypatch.delenv("LOGLEVEL", raising=False)
        assert node.main([str(script), str(seen)]) == 0 and seen.read_text() == "CRITICAL"
        monkeypatch.setenv("LOGLEVEL", "INFO")
        assert node.main([str(script), str(seen)]) == 0 and seen.read_text() == "INFO"
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
