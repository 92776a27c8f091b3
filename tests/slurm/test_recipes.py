"""Recipes under a real Slurm (two slurmd nodes on this host) through ``sbatch recipes/slurm.sbatch``: a 2-node run
saves what the same run on one node saves, and a run stopped by ``scontrol requeue`` is requeued, resumes from its
newest committed checkpoint by itself (and again after a SIGTERM for its step alone, which the script requeues) and
ends with the uninterrupted run's model. The time-limit warning:
test_time_limit.py; lost nodes (one of them while a checkpoint is written) and bugs: test_node_loss.py.

Every DPO run is the same job (``jobs.DPO``), so one uninterrupted 2-node run is the reference of all of them; the
FSDP2 case trains SFT.
"""


import pytest

from tests.slurm.jobs import (
    DPO,
    SAVE_STEPS,
    assert_same_model,
    finished,
    node_lines,
    quiet,
    slowed,
    submit,
    wait_for,
    wait_for_line,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]



def test_two_nodes_train_what_one_node_trains(slurm_cluster, reference, early):
    out, log = reference
    assert "2 machine(s), this one number 0, 2 processes, rendezvous 127.0.0.1:" in log, log[-4000:]
    assert "replace the accelerate config's machines" in log
    job, one = early["one-node"]
    finished(slurm_cluster, job, one)
    assert_same_model(out, one)


def test_a_requeued_job_resumes_from_its_checkpoint_by_itself(slurm_cluster, reference, tmp_path):
    out = tmp_path / "requeued"
    # its first two runs are still training when they are stopped
    args, env = slowed(DPO, runs="0,1", step_seconds=0.25)
    job = submit(slurm_cluster, out, args, env=env)
    wait_for(lambda: (out / f"checkpoint-{SAVE_STEPS}").is_dir(), 400, f"checkpoint-{SAVE_STEPS}", slurm_cluster, job)
    slurm_cluster.requeue(job)
    slurm_cluster.start_now(job)
    # Run 1: SIGTERM to its step alone, as a node that comes back delivers one slurmctld held for the job's lost run
    # (the batch script gets none): the ranks save and stop, and the script requeues the job.
    wait_for_line(out, f"Slurm job {job}, restart 1: resuming from", cluster=slurm_cluster, job=job)
    slurm_cluster.cancel(job, "--signal=TERM")
    log = finished(slurm_cluster, job, out, min_restarts=2)
    # One line per node for each stop, with the checkpoint saved and the code the script sees, then the script's
    stops = [line for line in node_lines(log) if "stopped on SIGTERM, with checkpoint-" in line]
    assert len(stops) == 4 and all(line.endswith("saved (exit 143)") for line in stops), log[-6000:]
    assert f"Slurm job {job}: stopped on SIGTERM with a checkpoint" in log, log[-6000:]
    assert (f"Slurm job {job}: its ranks stopped on a SIGTERM for the step alone, with a checkpoint" in log and
            "requeued (failure 1 of 3 in a row without a new checkpoint" in log), log[-6000:]
    quiet(log)
    for restart in (1, 2):
        assert f"Slurm job {job}, restart {restart}: resuming from {out}/checkpoint-" in log, log[-6000:]
    assert_same_model(out, reference[0])


def test_an_fsdp2_recipe_on_two_nodes_trains_what_one_node_trains(slurm_cluster, early):
    (two_job, two), (one_job, one) = early["fsdp2-two"], early["fsdp2-one"]
    finished(slurm_cluster, two_job, two)
    finished(slurm_cluster, one_job, one)
    assert_same_model(two, one)
