"""The time-limit warning under a real Slurm, in one job of three runs, each signalled where the test chooses (holds in
tests/slurm/slowed.py, released by the test; the warning sent as Slurm sends it, to the batch shell):

- run 0 is warned while it starts: nothing is measured yet, so it stops at the first step boundary the warning
  reaches (the launchers send it again every 5 s; its steps take at least 2.5 s) with a checkpoint; the script
  requeues the job, and the test starts it again at once (a self-requeued job's end must not end its next run);
- run 1 is warned while it loads that checkpoint, trains on (the time left is far above what a stop needs, measured
  in run 0), is warned again while checkpoint-20 is written and trains on; then the time limit is lowered to a little
  above what a stop needs, and it trains until the time left comes down to that, then stops with a checkpoint;
- run 2 is warned while it writes the final model: it finishes.

Every stop is quiet (one line per node, no traceback), every run ends as the script says, and the job ends with the
uninterrupted run's model.
"""

import functools
import re

import pytest

from tests.slurm.jobs import (
    DPO,
    SAVE_STEPS,
    assert_same_model,
    finished,
    log_of,
    quiet,
    release,
    slowed,
    submit,
    wait_for,
    wait_for_line,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

LIMIT_MINUTES = 30  # far more than the job needs, until the test lowers it
MARGIN = 20  # seconds above a stop's need the lowered limit leaves: the run must train on through them


def warn(cluster, job: str) -> None:
    """The time-limit warning as ``--signal=B:USR1`` sends it: SIGUSR1 to the batch shell only."""
    cluster.cancel(job, "--batch", "--signal=USR1")


@pytest.fixture(scope="module")
def warned_job(slurm_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("time-limit")
    out, holds = tmp / "warned", tmp / "holds"
    holds.mkdir()
    # every step takes 2.5 s at least: run 0 stops within a few steps of the first, and run 1 is still training when
    # its lowered limit comes near, however long this loaded host takes to lower it (its 40 steps after checkpoint-20
    # last 100 s; the stop comes within MARGIN + 10 s of the limit's change; at 1.5 s a step, 60 s, the run once
    # finished first)
    args, env = slowed(DPO, runs="0,1,2", step_seconds=2.5, hold=f"load,checkpoint-{SAVE_STEPS},final",
                       hold_dir=holds)
    job = submit(slurm_cluster, out, args, sbatch=[f"--time={LIMIT_MINUTES}"], env=env)
    line = functools.partial(wait_for_line, out, cluster=slurm_cluster, job=job)

    # run 0: warned while it starts (the script's first line is printed once it listens for the warning)
    at = line(f"Slurm job {job}, restart 0: ", timeout=300)
    warn(slurm_cluster, job)
    # its script requeues the job; started again the moment it is pending (no wait for the next second)
    slurm_cluster.wait_state(job, "PENDING", timeout=400, min_restarts=1)
    slurm_cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])

    # run 1: warned while it loads run 0's checkpoint, then while checkpoint-20 is written
    at = line("[test] holding load", timeout=300, after=at)
    warn(slurm_cluster, job)
    release(holds, "load")
    at = line("so training goes on until", after=at)
    at = line(f"[test] holding checkpoint-{SAVE_STEPS}", after=at)
    warn(slurm_cluster, job)
    release(holds, f"checkpoint-{SAVE_STEPS}")
    # the limit lowered to a little above what a stop needs (the line says it), counted from now
    need = float(re.findall(r"so training goes on until (\d+) s are left", log_of(out))[-1])
    limit = int(_elapsed(slurm_cluster, job) + need + MARGIN)
    slurm_cluster.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={limit // 60}:{limit % 60:02d}"])
    at = line(f"Slurm job {job}: stopped on the time-limit warning", timeout=300, after=at)
    # held once requeued, so that its next run starts with the whole limit again
    slurm_cluster.run(["scontrol", "hold", job])
    slurm_cluster.wait_state(job, "PENDING", timeout=300, min_restarts=2)
    slurm_cluster.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={LIMIT_MINUTES}"])
    slurm_cluster.release(job)
    slurm_cluster.start_now(job)

    # run 2: warned while it writes the final model
    line("[test] holding final", timeout=300, after=at)
    warn(slurm_cluster, job)
    release(holds, "final")
    log = finished(slurm_cluster, job, out, timeout=300, min_restarts=2)
    return job, out, log, need


def _elapsed(cluster, job: str) -> float:
    """Seconds the job's current run has been running (``squeue %M``)."""
    text = cluster.run(["squeue", "-h", "-j", job, "-o", "%M"]).stdout.strip()
    parts = [int(p) for p in re.split("[-:]", text)]
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + part
    return float(seconds)


def _runs(log: str) -> list[str]:
    """The log split by run (the script's first line of each)."""
    return re.split(r"(?=\[trl_ext\] Slurm job \d+, restart \d+: \d+ node\(s\))", log)[1:]


def test_a_warning_while_starting_stops_once_training_starts_and_the_job_started_again_at_once_runs(warned_job):
    job, out, log, _ = warned_job
    run = _runs(log)[0]
    # one line per node, with the checkpoint saved and the code the script sees
    stops = re.findall(r"node \d \(n\d\): stopped on the time-limit warning, with checkpoint-(\d+) saved \(exit 138\)",
                       run)
    assert len(stops) == 2 and stops[0] == stops[1] and int(stops[0]) < SAVE_STEPS, run[-6000:]
    assert f"Slurm job {job}: stopped on the time-limit warning with a checkpoint; requeued" in run, run[-4000:]
    assert f"Slurm job {job}, restart 1: resuming from {out}/checkpoint-{stops[0]}\n" in log, log[-6000:]


def test_warnings_while_loading_and_checkpointing_leave_a_run_training_until_its_checkpoint_must_start(warned_job):
    job, out, log, need = warned_job
    run = _runs(log)[1]
    going_on = re.findall(r"time-limit warning at step (\d+): (\d+) s left; .* until (\d+) s are left", run)
    assert going_on and int(going_on[0][1]) > need, run[-6000:]  # warned with far more time than a stop needs
    stopped = [int(n) for n in re.findall(r"stopped on the time-limit warning, with checkpoint-(\d+) saved", run)]
    assert len(stopped) == 2 and stopped[0] > SAVE_STEPS, run[-6000:]  # trained on past both warnings
    assert f"Slurm job {job}, restart 2: resuming from {out}/checkpoint-{stopped[0]}\n" in log, log[-6000:]


def test_a_warning_while_the_final_model_is_written_changes_nothing(warned_job):
    job, _, log, _ = warned_job
    run = _runs(log)[2]
    assert f"Slurm job {job}: finished" in run and "stopped on" not in run, run[-4000:]


def test_every_planned_stop_is_quiet_and_the_job_ends_with_the_uninterrupted_model(warned_job, reference):
    _, out, log, _ = warned_job
    quiet(log)
    assert_same_model(out, reference[0])


def test_nothing_of_the_warnings_is_left_behind(warned_job):
    _, out, _, _ = warned_job
    wait_for(lambda: not list(out.glob(".*partial")), 5, "no partial directory")
