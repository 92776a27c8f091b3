"""Slurm, in one process (the real cluster runs are in tests/slurm): the job read from Slurm's variables, the launch
command Slurm's decisions make, the output directory named by the job and resumed after a requeue (never another
job's), and the sbatch script's syntax."""

import subprocess
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tests.harness import REPO
from trl_ext.errors import UsageError
from trl_ext.launching import launch, scripting
from trl_ext.launching import node as node_launcher
from trl_ext.placement import orchestrators, ownership
from trl_ext.placement.orchestrators import slurm
from trl_ext.resuming import choose

JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n[1-2]"}


@pytest.fixture
def in_job(monkeypatch):
    """This process as one of job 4242's: first run (restart 0) unless the test says otherwise."""
    for key in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_RESTART_COUNT", orchestrators.NODE_ENV, "RANK", "WORLD_SIZE",
                "LOCAL_RANK", orchestrators.RUN_ID_ENV):
        monkeypatch.delenv(key, raising=False)
    for key, value in JOB.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


def test_the_job_is_read_from_slurms_variables(in_job):
    in_job.setattr(slurm, "main_address", lambda hosts: f"first of {hosts}")
    in_job.setenv("SLURMD_NODENAME", "n1")
    job = orchestrators.current()  # whole: nothing is filled in later
    assert (job.orchestrator, job.job_id, job.restart, job.nodes, job.node_rank, job.address, job.host) == (
        "Slurm", "4242", 0, 2, 0, "first of n[1-2]", "n1")
    assert job.port == orchestrators.meeting_port("slurm-4242")  # the one derivation of a meeting port
    assert orchestrators.PORT_BASE <= job.port < orchestrators.PORT_BASE + orchestrators.PORT_SPAN
    in_job.setenv("SLURM_RESTART_COUNT", "2")
    assert orchestrators.current().restart == 2
    in_job.setenv("SLURM_JOB_NUM_NODES", "1")
    assert orchestrators.current().address is None  # one machine: nothing to ask Slurm
    in_job.delenv("SLURM_JOB_ID")
    assert orchestrators.current() is None


def _node(in_job, gpus=0, node_rank=1):
    """The Slurm node launcher's view of this node, as it hands it to the recipe."""
    in_job.setattr(slurm, "main_address", lambda hosts: "10.0.0.7")
    in_job.setenv("SLURM_NODEID", str(node_rank))
    in_job.setenv("SLURM_GPUS_ON_NODE", str(gpus))
    job = node_launcher.machine()
    in_job.setenv(orchestrators.NODE_ENV, job.to_env())
    return job


@pytest.mark.parametrize("gpus, asked, total", [(0, None, 4), (8, None, 16), (0, 2, 2)])
def test_slurm_decides_the_machines_ranks_address_and_port(in_job, gpus, asked, total):
    job = _node(in_job, gpus)
    # the recipe under the node launcher sees what the launcher decided, and that the launcher handed it down
    assert orchestrators.current() == replace(job, node_launched=True)
    args, _ = launch.machine_args(job, asked)
    options = {args[i]: args[i + 1] for i in range(len(args) - 1)}
    assert (options["--num_machines"], options["--machine_rank"], options["--main_process_ip"],
            options["--main_process_port"], options["--num_processes"]) == ("2", "1", "10.0.0.7", str(job.port),
                                                                             str(total))
    assert job.port == orchestrators.meeting_port("slurm-4242")  # derived from the job id: the same on every node
    assert options["--deepspeed_multinode_launcher"] == "standard"  # torchrun on each node, not pdsh


def test_one_process_per_gpu_slurm_allocated_else_per_visible_device(in_job):
    in_job.setattr(slurm, "main_address", lambda hosts: "10.0.0.7")
    in_job.setenv("SLURM_GPUS_ON_NODE", "8")
    in_job.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert orchestrators.local_gpus(orchestrators.current()) == 8  # what Slurm allocated to this node
    in_job.delenv("SLURM_GPUS_ON_NODE")
    assert orchestrators.local_gpus(orchestrators.current()) == 2
    in_job.setenv("CUDA_VISIBLE_DEVICES", "-1")  # the usual way of hiding every GPU
    assert orchestrators.local_gpus(orchestrators.current()) == 0


def test_the_log_says_what_slurm_replaced(in_job):
    job = _node(in_job, node_rank=0)
    _, line = launch.machine_args(job)
    assert (f"Slurm job 4242 (restart 0): 2 machine(s), this one number 0, 4 processes, rendezvous 10.0.0.7:{job.port}"
            in line)
    assert "replace the accelerate config's machines, ranks, address and port" in line


def test_the_node_launcher_refuses_outside_a_job(monkeypatch):
    for key in ("SLURM_JOB_ID", "SLURM_JOBID", orchestrators.NODE_ENV, "PET_NNODES", "SKYPILOT_NODE_RANK",
                "LWS_LEADER_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(UsageError, match="sbatch recipes/slurm.sbatch"):
        node_launcher.main(["recipes/dpo.py"])


def _args(out, resume=None):
    return SimpleNamespace(output_dir=str(out) if out else None, resume_from_checkpoint=resume)


def _trainer_args(args):
    return SimpleNamespace(output_dir=args.output_dir, process_index=0, world_size=1)


def test_the_output_directory_is_the_jobs_and_a_requeued_run_resumes_from_it(in_job, tmp_path, caplog):
    in_job.chdir(tmp_path)
    args = _args(None)
    scripting.prepare_output_dir(args, "dpo")
    out = tmp_path / "outputs" / "dpo-slurm-4242"
    assert args.output_dir == "outputs/dpo-slurm-4242" and ownership.run_of(out) == "slurm-4242"  # marked for the job
    (out / "checkpoint-20").mkdir()
    (out / "checkpoint-40").mkdir()
    (out / ".checkpoint-60.trl_ext-partial").mkdir()  # being written when the job died: never picked
    in_job.setenv("SLURM_RESTART_COUNT", "1")
    requeued = _args(None)
    scripting.prepare_output_dir(requeued, "dpo")  # the job's own directory is not refused: it trains on into it
    assert requeued.output_dir == "outputs/dpo-slurm-4242" and requeued.resume_from_checkpoint is None
    with caplog.at_level("WARNING", logger="trl_ext"):  # and its trainer resumes, saying so once
        assert choose.restarted_checkpoint(_trainer_args(requeued)) == "outputs/dpo-slurm-4242/checkpoint-40"
    assert caplog.text.count("Slurm job 4242, restart 1: resuming from outputs/dpo-slurm-4242/checkpoint-40") == 1


def test_a_fresh_job_never_resumes_another_jobs_directory(in_job, tmp_path):
    out = tmp_path / "mine"
    (out / "checkpoint-20").mkdir(parents=True)
    (out / ownership.RUN_MARKER).write_text('{"run": "slurm-1111"}')  # another job's
    with pytest.raises(UsageError, match="already holds files from another run"):
        scripting.prepare_output_dir(_args(out), "dpo")
    asked = _args(out, resume="true")  # unless asked
    scripting.prepare_output_dir(asked, "dpo")
    assert asked.resume_from_checkpoint == str(out / "checkpoint-20")
    assert choose.after_restart(out) is None  # and a trainer does not resume it by itself


def test_a_requeued_job_without_a_committed_checkpoint_starts_over(in_job, tmp_path, caplog):
    out = tmp_path / "mine"
    ownership.claim(out)
    in_job.setenv("SLURM_RESTART_COUNT", "1")
    args = _args(out)
    scripting.prepare_output_dir(args, "dpo")
    with caplog.at_level("WARNING", logger="trl_ext"):
        assert choose.restarted_checkpoint(_trainer_args(args)) is None
    assert args.resume_from_checkpoint is None and "holds no committed checkpoint yet" in caplog.text


def test_the_sbatch_script_parses_and_asks_slurm_for_what_it_needs():
    script = REPO / "recipes" / "slurm.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    for directive in ("--signal=B:USR1@", "--requeue", "--open-mode=append"):
        assert f"#SBATCH {directive}" in text, directive
    # Not as a job option: with a node range, Slurm 22.05 then sets the job's tasks to the range's minimum times it
    # (job_mgr.c, _validate_job_desc) and allocates the minimum number of nodes; srun asks for it per step instead.
    assert "#SBATCH --ntasks-per-node" not in text and "#SBATCH --ntasks" not in text
    assert "srun --ntasks-per-node=1" in text
    assert "python -m trl_ext.launching.node" in text and "python -m trl_ext.launching.restart" in text


def test_a_wait_on_a_jobs_log_counts_only_the_seconds_it_stayed_unchanged(tmp_path, monkeypatch):
    """The Slurm tests' hang bound (`tests/slurm/cluster.RunClock` with the job's log): a job that prints is slow, not
    hung, however long it runs; the time it spends queued never counts."""
    from tests.slurm import cluster

    now = [0.0]
    monkeypatch.setattr(cluster.time, "monotonic", lambda: now[0])
    states = iter(["PENDING", "RUNNING", "RUNNING", "RUNNING", "RUNNING"])

    class Jobs:
        def job_info(self, job_id):
            return {"JobState": next(states)}

    log = tmp_path / "job.log"
    clock = cluster.RunClock(Jobs(), "1", count_pending=False, output=log)
    clock.tick()  # no log yet: pending
    now[0] = 100.0
    clock.tick()  # the 100 s pending do not count; the log is still missing
    assert clock.seconds == 0
    now[0] = 150.0
    log.write_text("step 1\n")
    clock.tick()
    assert clock.seconds == 0  # it grew: the count starts again
    now[0] = 450.0
    clock.tick()
    assert clock.seconds == 300  # unchanged for 300 s
    now[0] = 460.0
    log.write_text("step 1\nstep 2\n")
    clock.tick()
    assert clock.seconds == 0
