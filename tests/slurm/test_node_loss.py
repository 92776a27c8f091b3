"""A node that dies mid-run, under a real Slurm, and a bug. Node n2 is killed as a power loss would (its slurmd, its
slurmstepd daemons and every task on it, with SIGKILL) while two jobs train on both nodes, each held in the write of
its checkpoint-40 (tests/slurm/slowed.py), so both are mid-run at a known point, and that checkpoint is never
committed:

- ``-N 2`` (one process per node), with memory checkpoints every 6 steps, each node its own memory tier: requeued, it
  waits for two nodes; n2 comes back (once slurmctld holds no message it would send again to n2,
  `SlurmCluster.retries_pending`) with its memory, and the job resumes from step 36 in memory (not the disk's
  checkpoint-20) and ends with the model of the uninterrupted run, which takes no memory checkpoints (a SIGTERM
  slurmctld still held for the lost run, delivered to the next run's step, requeues it once more:
  `trl_ext/launching/restart.py`);
- ``-N 1-2`` (two processes per node, 24 steps, held in the write of its last checkpoint): it got both nodes while
  they were free; requeued, it goes on on n1 alone, at another number of processes with the same global batch (two
  batches accumulated), and ends on the trajectory of the same job run uninterrupted on one node with two batches
  accumulated (the same micro-batches, so the same objective; only the order of the sums differs): within 1% of the
  way training moved the model.

And a run whose first rank raises in step 5 (submitted with the session's early jobs, on n1) ends FAILED, once, with
its error: never requeued.
"""

import pytest

from tests.slurm.jobs import (
    DPO,
    RANGED,
    RANGED_STEPS,
    SAVE_STEPS,
    assert_on_trajectory,
    assert_same_model,
    finished,
    log_of,
    node_lines,
    release,
    slowed,
    submit,
    wait_for,
    wait_for_line,
)
from trl_ext.assets import resolve_model

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

HELD = f"checkpoint-{2 * SAVE_STEPS}"
MEMORY_STEPS = 6  # the -N 2 job's: its newest memory checkpoint when n2 dies is 36, replicated before checkpoint-40
RANGED_HELD = f"checkpoint-{RANGED_STEPS}"  # its last checkpoint


@pytest.fixture(scope="module")
def lost_node(slurm_cluster, early, tmp_path_factory):
    for name in ("reference", "fsdp2-two"):  # nothing else may be on n2 when it dies
        slurm_cluster.wait_done(early[name][0], timeout=600)
    tmp = tmp_path_factory.mktemp("node-loss")
    holds = tmp / "holds"
    holds.mkdir()
    fixed, ranged = tmp / "fixed", tmp / "ranged"
    args, env = slowed([*DPO, "--memory_checkpoint_steps", str(MEMORY_STEPS)], hold=HELD, hold_dir=holds,
                       memory_dir=tmp / "shm-{node}")
    two = submit(slurm_cluster, fixed, args, nodes=2, env=env)
    args, env = slowed(RANGED, hold=RANGED_HELD, hold_dir=holds)
    one_or_two = submit(slurm_cluster, ranged, args, nodes="1-2", env=env)
    wait_for_line(fixed, f"[test] holding {HELD}", timeout=400, cluster=slurm_cluster, job=two)
    wait_for_line(ranged, f"[test] holding {RANGED_HELD}", timeout=400, cluster=slurm_cluster,
                  job=one_or_two)
    slurm_cluster.kill_node("n2")
    for held in (HELD, RANGED_HELD):  # the first ranks finish their part of the checkpoint and find their peers gone
        release(holds, held)

    # -N 1-2: requeued (by its script, or by Slurm once n2 is DOWN) and run again on n1 alone
    ranged_log = finished(slurm_cluster, one_or_two, ranged, timeout=600, min_restarts=1)
    # -N 2: pending until n2 is back, which it is once nothing stale can reach it
    slurm_cluster.wait_state(two, "PENDING", timeout=300, min_restarts=1)
    wait_for(lambda: slurm_cluster.retries_pending() == 0, 300, "slurmctld to drop its messages to the dead node")
    wait_for(lambda: not slurm_cluster.job_processes(two), 300, "the earlier run's srun to end")
    slurm_cluster.revive_node("n2")
    fixed_log = finished(slurm_cluster, two, fixed, timeout=600, min_restarts=1)
    job, ranged_reference = early["ranged-reference"]
    finished(slurm_cluster, job, ranged_reference, timeout=600)
    return {"fixed": (two, fixed, fixed_log), "ranged": (one_or_two, ranged, ranged_log),
            "ranged_reference": ranged_reference}


def _first_run_lost_its_peer(log: str) -> None:
    lost = [line for line in node_lines(log) if "lost a peer or its node" in line]
    assert lost and lost[0].startswith("[trl_ext] Slurm job") and lost[0].endswith("(exit 200)"), log[-6000:]


def test_a_job_on_two_nodes_waits_for_the_node_to_come_back_and_ends_with_the_uninterrupted_model(lost_node,
                                                                                                  reference):
    job, out, log = lost_node["fixed"]
    _first_run_lost_its_peer(log)
    assert f"Slurm job {job}, restart 1: 2 node(s) n[1-2]" in log, log[-6000:]
    newest = 2 * SAVE_STEPS // MEMORY_STEPS * MEMORY_STEPS  # 36: the one before the held checkpoint-40
    resumed = [line for line in log.splitlines() if f"Slurm job {job}, restart 1: resuming from" in line]
    assert resumed and f"resuming from step {newest} in memory (" in resumed[0] and \
        f"the newest on disk is checkpoint-{SAVE_STEPS}" in resumed[0], resumed or log[-6000:]
    assert not list(out.glob(".*partial")), "the interrupted checkpoint's partial directory was left behind"
    assert_same_model(out, reference[0])  # the reference takes no memory checkpoints


def test_a_job_with_a_node_range_goes_on_with_the_node_it_has_at_another_world_size(lost_node):
    job, out, log = lost_node["ranged"]
    assert f"Slurm job {job}, restart 0: 2 node(s) n[1-2]" in log, log[-6000:]  # the range's maximum, while free
    _first_run_lost_its_peer(log)
    assert f"Slurm job {job}, restart 1: 1 node(s) n1" in log, log[-6000:]
    assert f"Slurm job {job}, restart 1: resuming from {out}/checkpoint-{SAVE_STEPS}\n" in log, log[-6000:]
    assert ("resuming a checkpoint saved on 4 processes on 2: gradient_accumulation_steps 1 -> 2, to keep the global "
            "batch size of 16") in log, log[-6000:]
    share = assert_on_trajectory(out, lost_node["ranged_reference"], resolve_model("trl-ext/tiny-llama-arith"))
    print(f"\nthe resumed run ends {share:.3%} of training's way from the uninterrupted one")


def test_a_bug_ends_the_job_failed_once_with_its_error(slurm_cluster, early):
    job, out = early["buggy"]
    info = slurm_cluster.wait_done(job, timeout=300)
    log = log_of(out)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", log[-6000:]
    assert "ValueError: a bug at step 5" in log, log[-6000:]  # the error itself, as the rank raised it
    assert any("rank 0 failed: ValueError: a bug at step 5 (exit 201)" in line for line in node_lines(log)), log[-6000:]
    assert f"Slurm job {job}: failed: a rank raised an error" in log and "restart 1" not in log, log[-6000:]
