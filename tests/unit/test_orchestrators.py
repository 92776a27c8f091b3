"""Every launcher's variables, in one process: which machines, which one am I, where do we meet, which run is this,
was I restarted; what a recipe then does (train as the rank, start the machine's ranks, or re-launch), decided before
torch is imported; contradictory variables refused in one line naming the variable, on every process; the machines'
bounded meeting; and a restarted run that refuses to repeat an error of its own. The real launches are in
tests/distributed/test_launchers.py."""

import json
import os
import subprocess
import sys
import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tests.harness import REPO
from tests.launcher_env import clean_launcher_env
from tests.machines import free_ports
from trl_ext.errors import SetupError, UsageError
from trl_ext.launching import decision, in_process, launch, node, rendezvous, scripting
from trl_ext.placement import orchestrators, outcome, ownership

ZERO3 = "accelerate_configs/zero3.yaml"
# Every variable a reader looks at: each test starts from none of them.
ALL = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
       "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "PET_NNODES", "PET_NODE_RANK",
       "PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_NPROC_PER_NODE", "JOB_COMPLETION_INDEX", "JOBSET_NAME",
       "LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS",
       "SKYPILOT_NUM_NODES", "SKYPILOT_NUM_GPUS_PER_NODE", "SKYPILOT_TASK_ID", "SLURM_JOB_ID", "SLURM_JOBID",
       "SLURM_RESTART_COUNT", "SLURM_NODEID", orchestrators.NODE_ENV, orchestrators.RUN_ID_ENV,
       orchestrators.PORT_ENV, decision.LAUNCH_ENV, "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", ownership.RUN_ENV,
       "HOSTNAME", "PET_RDZV_ENDPOINT", "PET_RDZV_BACKEND", "PET_RDZV_ID", "PET_RDZV_CONF", "PET_MAX_RESTARTS",
       "PET_N_PROC_PER_NODE", "TRL_EXT_RENDEZVOUS_TIMEOUT", "TRL_EXT_MAX_FAILURES")

KUBEFLOW = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "auto", "PET_MASTER_PORT": "29500",
            "PET_MASTER_ADDR": "dpo-run-node-0-0.dpo-run"}
# A PyTorchJob's elastic policy (training-operator's pkg/controller.v1/pytorch/elastic.go): no node rank, no first pod's
# address; the pods meet at the rendezvous endpoint, and torchrun numbers them
ELASTIC = {"PET_NNODES": "1:4", "PET_RDZV_ENDPOINT": "dpo-worker-0:23456", "PET_RDZV_BACKEND": "c10d",
           "PET_MAX_RESTARTS": "5", "PET_N_PROC_PER_NODE": "2", "PET_RDZV_CONF": "last_call_timeout=10",
           "HOSTNAME": "dpo-worker-2"}
SKYPILOT = {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2", "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NUM_GPUS_PER_NODE": "0", "SKYPILOT_TASK_ID": "sky-managed-2026_dpo_3-0"}
TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "job7",
            "TORCHELASTIC_RESTART_COUNT": "2"}


@pytest.fixture
def env(monkeypatch):
    """Set a launcher's variables (none else set); returns the setter."""
    return clean_launcher_env(monkeypatch, ALL)


def test_no_orchestrator(env):
    assert orchestrators.current() is None


def test_a_torchrun_rank(env):
    env(**TORCHRUN)
    job = orchestrators.current()
    assert job.per_rank and (job.rank, job.world_size, job.nodes, job.node_rank) == (3, 4, 2, 1)
    assert (job.address, job.port, job.run, job.restart) == ("10.0.0.1", 29400, "torchrun-job7", 2)
    assert job.describe() == ("torchrun: rank 3 of 4 on 2 machine(s), rendezvous 10.0.0.1:29400, run torchrun-job7, "
                              "restart 2")


def test_torchruns_default_rendezvous_id_names_no_run(env):
    env(**{**TORCHRUN, "TORCHELASTIC_RUN_ID": "none"})
    assert orchestrators.current().run is None


def test_kubeflow_pods_whose_command_is_the_recipe(env):
    env(**KUBEFLOW)
    job = orchestrators.current()
    assert not job.per_rank and (job.nodes, job.node_rank, job.address, job.port) == (
        2, 1, "dpo-run-node-0-0.dpo-run", 29500)
    assert job.per_node is None  # "auto": one per GPU, 2 on CPU
    assert job.run == "trainjob-dpo-run"  # Kubeflow Trainer's first pod names the TrainJob: the same when recreated


def test_a_pytorchjob_pods_own_rank_is_not_a_processes(env):
    """Training-operator v1 sets RANK to the pod's index and WORLD_SIZE to the pod count (no LOCAL_RANK)."""
    env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="dpo-master-0", MASTER_PORT="23456", PET_NNODES="2",
        PET_NODE_RANK="1", PET_NPROC_PER_NODE="4", PET_MASTER_ADDR="dpo-master-0", PET_MASTER_PORT="23456")
    job = orchestrators.current()
    assert not job.per_rank and (job.nodes, job.node_rank, job.per_node, job.run) == (2, 1, 4, "k8s-dpo-master-0")


def test_torchrun_in_a_kubeflow_pod_keeps_the_trainjob_as_the_run(env):
    env(**KUBEFLOW, **{**TORCHRUN, "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0"})
    job = orchestrators.current()
    assert job.per_rank and job.orchestrator == "Kubeflow" and job.run == "trainjob-dpo-run"


def test_a_jobset_that_sets_torchruns_variables(env):
    env(PET_NNODES="2", JOB_COMPLETION_INDEX="1", PET_MASTER_ADDR="10.1.0.4", JOBSET_NAME="dpo")
    job = orchestrators.current()
    assert (job.nodes, job.node_rank, job.port, job.run) == (2, 1, orchestrators.TORCHRUN_PORT, "jobset-dpo")


def test_a_jobset_of_replicated_jobs_takes_the_job_index_or_is_refused(env):
    # `replicas: 2` Jobs of one pod each: JOB_COMPLETION_INDEX is 0 in both; the manifest passes the Job's index
    env(PET_NNODES="2", JOB_COMPLETION_INDEX="0", PET_NODE_RANK="1", PET_MASTER_ADDR="dpo-workers-0-0.dpo",
        JOBSET_NAME="dpo", HOSTNAME="dpo-workers-1-0")
    assert orchestrators.current().node_rank == 1
    # without it, the second Job's pod says so in one line at once (not a 600 s wait at the first machine)
    env().delenv("PET_NODE_RANK")
    with pytest.raises(UsageError, match=r"JOB_COMPLETION_INDEX=0 .* \(dpo-workers-1-0\) is in Job 1 of JobSet dpo.* "
                                         r"Set PET_NODE_RANK .*jobset\.sigs\.k8s\.io/job-index"):
        orchestrators.current()
    # without JOBSET_NAME too: the first pod's address names the replicated Job
    env().delenv("JOBSET_NAME")
    with pytest.raises(UsageError, match=r"\(dpo-workers-1-0\) is in Job 1 of its JobSet"):
        orchestrators.current()
    env(JOBSET_NAME="dpo")
    # one Job of 2 pods (`parallelism: 2`): the completion index is the machine's
    env(JOB_COMPLETION_INDEX="1", HOSTNAME="dpo-workers-0-1")
    assert orchestrators.current().node_rank == 1


def test_a_leader_worker_set_group(env):
    env(LWS_LEADER_ADDRESS="dpo-0.dpo.default", LWS_GROUP_SIZE="3", LWS_WORKER_INDEX="2")
    job = orchestrators.current()
    assert (job.orchestrator, job.nodes, job.node_rank, job.address, job.run) == (
        "LeaderWorkerSet", 3, 2, "dpo-0.dpo.default", "lws-dpo-0")


def test_skypilot_nodes(env):
    env(**SKYPILOT)
    job = orchestrators.current()
    assert (job.nodes, job.node_rank, job.address, job.per_node) == (2, 1, "10.0.0.1", None)
    assert job.run == "skypilot-sky-managed-2026_dpo_3-0"  # kept across a managed job's recoveries
    assert orchestrators.PORT_BASE <= job.port < orchestrators.PORT_BASE + orchestrators.PORT_SPAN
    assert job.port == orchestrators.current().port  # the same on every node
    env(SKYPILOT_NUM_GPUS_PER_NODE="8", **{orchestrators.PORT_ENV: "31000"})
    assert (orchestrators.current().per_node, orchestrators.current().port) == (8, 31000)


def test_the_run_can_be_named_anywhere(env):
    env(**SKYPILOT, **{orchestrators.RUN_ID_ENV: "my-run"})
    assert orchestrators.current().run == "my-run"


def test_the_node_launchers_view_reaches_its_ranks(env):
    env(**SKYPILOT)
    job = orchestrators.current()
    env(**{orchestrators.NODE_ENV: job.to_env(), **TORCHRUN, "TORCHELASTIC_RUN_ID": "none",
           "TORCHELASTIC_RESTART_COUNT": "0"})
    rank = orchestrators.current()
    assert rank.per_rank and rank.orchestrator == "SkyPilot" and rank.run == job.run and rank.rank == 3


@pytest.mark.parametrize("variables, named", [
    ({**KUBEFLOW, "PET_NODE_RANK": "2"}, "PET_NODE_RANK=2 is beyond PET_NNODES=2"),
    ({**KUBEFLOW, "PET_NNODES": "zero"}, "PET_NNODES='zero'"),
    ({**{k: v for k, v in KUBEFLOW.items() if k != "PET_MASTER_ADDR"}}, "PET_MASTER_ADDR is not set"),
    ({**KUBEFLOW, "PET_MASTER_PORT": "70000"}, "PET_MASTER_PORT=70000 is not a TCP port"),
    ({**KUBEFLOW, "PET_NPROC_PER_NODE": "eight"}, "PET_NPROC_PER_NODE='eight'"),
    ({**ELASTIC, "PET_NNODES": "3:2"}, "PET_NNODES='3:2': the fewest machines is above the most"),
    ({"PET_NNODES": "1:2"}, "neither PET_RDZV_ENDPOINT nor PET_MASTER_ADDR says where its pods meet"),
    ({**SKYPILOT, "SKYPILOT_NUM_NODES": "3"}, "SKYPILOT_NODE_IPS lists 2 address(es) but SKYPILOT_NUM_NODES=3"),
    ({**SKYPILOT, "SKYPILOT_NODE_RANK": "5"}, "SKYPILOT_NODE_RANK=5 is beyond SKYPILOT_NUM_NODES=2"),
    ({"LWS_LEADER_ADDRESS": "a", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "2"}, "LWS_WORKER_INDEX=2 is beyond"),
    ({**TORCHRUN, "RANK": "4"}, "RANK=4 is beyond WORLD_SIZE=4"),
])
def test_contradictory_variables_are_named_in_one_line_on_every_process(env, variables, named):
    env(**{"RANK": "1", **variables})  # not rank 0: said here too
    with pytest.raises(UsageError) as error:
        orchestrators.current()
    assert named in str(error.value) and "\n" not in str(error.value)
    assert isinstance(error.value.code, str) and error.value.code.startswith("error: ")  # printed, exit code 1


class Exec(Exception):
    """What ``os.execve`` was asked to run (the test's stand-in raises it instead of replacing the process)."""


@pytest.fixture
def execs(monkeypatch):
    def execve(path, argv, environment):
        raise Exec(argv, environment)

    monkeypatch.setattr(os, "execve", execve)


def _exec_of(call):
    with pytest.raises(Exec) as caught:
        call()
    return caught.value.args


def test_a_rank_applies_the_accelerate_config_here_and_is_never_relaunched(env, execs, caplog):
    env(**TORCHRUN, ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")  # an outer accelerate config's, replaced
    with caplog.at_level("WARNING", logger="trl_ext"):
        rest = launch.start("recipes/dpo.py", ["--config", ZERO3, "--max_steps", "3"])
    assert rest == ["--max_steps", "3"]
    assert os.environ["ACCELERATE_USE_DEEPSPEED"] == "true" and os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    assert "ACCELERATE_USE_FSDP" not in os.environ and "FSDP_VERSION" not in os.environ
    assert launch.start("recipes/dpo.py", ["--config", ZERO3, "--max_steps", "3"]) == rest  # the recipe's second ask
    assert decision.decide(orchestrators.current(), accelerate=True).decided_before
    os.environ.pop(decision.LAUNCH_ENV)  # another process's first ask
    with pytest.raises(UsageError, match="the launcher started 4 processes"):
        launch.start("recipes/dpo.py", ["--config", ZERO3, "--num_processes", "2"])


def test_the_rank_says_which_launcher_and_world_it_found(env, execs, caplog):
    env(**{**TORCHRUN, "RANK": "0"})
    with caplog.at_level("WARNING", logger="trl_ext"):
        launch.start("recipes/dpo.py", ["--config", ZERO3])
    assert ("torchrun: rank 0 of 4 on 2 machine(s), rendezvous 10.0.0.1:29400, run torchrun-job7, restart 2; "
            f"{ZERO3} applied in each process (DeepSpeed ZeRO-3)") in caplog.text


def test_in_process_environment_is_accelerates_own(env):
    assert in_process.environment("accelerate_configs/fsdp2.yaml", 4)["FSDP_VERSION"] == "2"
    ddp = in_process.environment("accelerate_configs/ddp.yaml", 4)
    assert not any(key.startswith("FSDP_") or "DEEPSPEED" in key for key in ddp)


def test_one_machine_re_launches_under_accelerate(env, execs):
    argv, environment = _exec_of(lambda: launch.start("recipes/dpo.py", ["--config", ZERO3, "--max_steps", "3"]))
    assert argv[:5] == [sys.executable, "-m", "trl_ext.launching.accelerate_run", "--config_file", ZERO3]
    assert argv[argv.index("--num_processes") + 1] == "2" and argv[-3:] == ["recipes/dpo.py", "--max_steps", "3"]
    assert environment[decision.LAUNCH_ENV] == f"accelerate:{os.getpid()}"  # the ranks train, never re-decide


def test_one_process_per_machine_starts_the_node_launcher_then_the_machines_ranks(env, execs):
    env(**SKYPILOT, PET_NNODES="9")  # a pod's torchrun variables must not reach the machine's own torchrun
    argv, environment = _exec_of(lambda: launch.start("recipes/sft.py", ["--config", ZERO3]))
    assert argv == [sys.executable, "-m", "trl_ext.launching.node", "recipes/sft.py", "--config", ZERO3]
    env(**{orchestrators.NODE_ENV: orchestrators.current().to_env(),  # what the node launcher hands the recipe
           decision.LAUNCH_ENV: environment[decision.LAUNCH_ENV]})
    argv, environment = _exec_of(lambda: launch.start("recipes/sft.py", ["--config", ZERO3, "--x"]))
    options = dict(zip(argv, argv[1:]))
    assert (options["--num_machines"], options["--machine_rank"], options["--main_process_ip"],
            options["--num_processes"]) == ("2", "1", "10.0.0.1", "4")  # 2 CPU processes on each machine
    assert argv[-2:] == ["recipes/sft.py", "--x"] and "PET_NNODES" not in environment


def test_a_pytorchjob_pod_other_than_the_first_starts_its_ranks_too(env, execs):
    """RANK=1 (the pod's index) once made the recipe leave quietly: pod 1 trained nothing."""
    env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="dpo-master-0", MASTER_PORT="23456", PET_NNODES="2",
        PET_NODE_RANK="1", PET_MASTER_ADDR="dpo-master-0", PET_MASTER_PORT="23456")
    argv, _ = _exec_of(lambda: launch.start("recipes/dpo.py", ["--config", ZERO3]))
    assert argv[1:3] == ["-m", "trl_ext.launching.node"]


def test_processes_that_do_not_divide_among_the_machines_are_refused(env):
    env(**SKYPILOT)
    with pytest.raises(UsageError, match="--num_processes 3 does not divide among 2 machines"):
        launch.machine_args(orchestrators.current(), 3)


def test_the_decision_imports_neither_torch_nor_trl():
    code = ("import sys; from trl_ext.launching import launch; launch.start('recipes/dpo.py', ['--max_steps', '1']); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'trl', 'transformers', 'accelerate'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


def test_machines_meet_within_the_bound(env):
    env(**{rendezvous.TIMEOUT_ENV: "20"})
    port = free_ports()
    jobs = [orchestrators.Job("SkyPilot", False, nodes=2, node_rank=r, address="127.0.0.1", port=port)
            for r in (0, 1)]
    took, errors = [], []

    def meet(job):
        try:
            took.append(rendezvous.gather(job, say=lambda line: None))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=meet, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors and len(took) == 2


def test_a_machine_that_never_comes_is_named_within_the_bound(env):
    env(**{rendezvous.TIMEOUT_ENV: "1"})
    job = orchestrators.Job("SkyPilot", False, nodes=3, node_rank=0, address="127.0.0.1", port=free_ports())
    # the port named is the one the machines meet on (the rendezvous port + 1), where a user would look
    with pytest.raises(SetupError, match=rf"waited 1 s for 2 of 3 machines at 127\.0\.0\.1:{job.port + 1}: "
                                         r"machine\(s\) 1, 2 never arrived"):
        rendezvous.gather(job, say=lambda line: None)
    second = orchestrators.Job("SkyPilot", False, nodes=2, node_rank=1, address="127.0.0.1", port=free_ports())
    with pytest.raises(SetupError, match="could not reach the first machine"):
        rendezvous.gather(second, say=lambda line: None)


def _args(out):
    return SimpleNamespace(output_dir=str(out) if out else None, resume_from_checkpoint=None)


def test_a_named_runs_directory_is_its_own_and_another_runs_is_refused(env, tmp_path):
    env(**TORCHRUN).chdir(tmp_path)
    args = _args(None)
    scripting.prepare_output_dir(args, "dpo")
    assert args.output_dir == "outputs/dpo-torchrun-job7" and ownership.run_of(args.output_dir) == "torchrun-job7"
    (tmp_path / args.output_dir / "checkpoint-2").mkdir()
    again = _args(None)
    scripting.prepare_output_dir(again, "dpo")  # a restart trains on into it (and its trainer resumes)
    assert again.output_dir == args.output_dir
    env(TORCHELASTIC_RUN_ID="job8")
    with pytest.raises(UsageError, match="already holds files from another run"):
        scripting.prepare_output_dir(_args(tmp_path / args.output_dir), "dpo")


def test_a_restart_refuses_to_repeat_an_error_of_the_runs_own(env, tmp_path):
    env(**{**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "0"})
    ownership.claim(tmp_path)
    outcome.refuse_after_error(tmp_path)  # the first attempt: nothing earlier
    try:
        raise ConnectionError("Connection closed by peer")
    except ConnectionError as lost:
        assert outcome.record_attempt(lost, tmp_path)
    env(TORCHELASTIC_RESTART_COUNT="1")
    outcome.refuse_after_error(tmp_path)  # a lost peer is what a restart is for
    try:
        raise KeyError("chosen")
    except KeyError as bug:
        assert outcome.record_attempt(bug, tmp_path)
    env(TORCHELASTIC_RESTART_COUNT="2")
    with pytest.raises(UsageError) as refused:
        outcome.refuse_after_error(tmp_path)
    assert "torchrun run torchrun-job7, restart 2: attempt 1 ended in an error of its own on rank 3 (KeyError: " \
           "'chosen')" in str(refused.value)
    env(TORCHELASTIC_RESTART_COUNT="0")  # the run launched again, after a fix: its restarts count from here
    outcome.refuse_after_error(tmp_path)
    assert not (tmp_path / outcome.ATTEMPTS).exists()


def test_the_exit_codes_a_kubernetes_failure_policy_matches(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "failed-1.json").write_text(json.dumps({"kind": outcome.ERROR, "error": "KeyError: 'x'", "rank": "1"}))
    assert node.ending(str(run), 1) == (201, "rank 1 failed: KeyError: 'x' (exit 201)")


def test_gpus_are_counted_from_what_the_container_sees(monkeypatch, tmp_path):
    """NVIDIA's device plugin sets NVIDIA_VISIBLE_DEVICES, not CUDA_VISIBLE_DEVICES, and a container keeps the host's
    device numbers: a pod given GPUs 4-7 sees /dev/nvidia4 to /dev/nvidia7 and no /dev/nvidia0."""
    from trl_ext.placement.orchestrators import job

    for name in ("nvidia4", "nvidia5", "nvidia6", "nvidia7", "nvidiactl", "nvidia-uvm", "nvidia-caps", "null"):
        (tmp_path / name).touch()
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    assert job.visible_gpus(str(tmp_path)) == 4  # the device files, whatever their numbers
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    assert job.visible_gpus(str(tmp_path)) == 4
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "GPU-8c1e0f3a,GPU-27b9d411")  # the plugin's UUIDs
    assert job.visible_gpus(str(tmp_path)) == 2
    for hidden in ("none", "void"):
        monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", hidden)
        assert job.visible_gpus(str(tmp_path)) == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")  # CUDA's own list decides where it is set
    assert job.visible_gpus(str(tmp_path)) == 3
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES")
    assert job.visible_gpus(str(tmp_path / "missing")) == 0
    assert "torch" not in job.visible_gpus.__code__.co_names  # the launcher counts without importing torch


def test_an_elastic_pytorchjob_pod(env):
    env(**ELASTIC)
    job = orchestrators.current()
    assert job.elastic and not job.per_rank and (job.min_nodes, job.nodes, job.address, job.port) == (
        1, 4, "dpo-worker-0", 23456)
    assert (job.per_node, job.max_restarts, job.rendezvous_conf, job.host) == (2, 5, "last_call_timeout=10",
                                                                             "dpo-worker-2")
    assert job.run == "k8s-dpo-worker-0"  # the first pod's name: the same when the job's pods are recreated
    env(PET_RDZV_ID="dpo-7", PET_RDZV_ENDPOINT="10.0.0.1")  # as torchrun's ranks name the run; c10d's port
    job = orchestrators.current()
    assert (job.run, job.address, job.port) == ("torchrun-dpo-7", "10.0.0.1", 29400)
    # a manifest's own range with the first pod's address, and a rank of its own
    env().delenv("PET_RDZV_ENDPOINT")
    env(PET_MASTER_ADDR="dpo-node-0-0.dpo", PET_MASTER_PORT="29500", PET_NODE_RANK="1")
    job = orchestrators.current()
    assert job.elastic and (job.address, job.port) == ("dpo-node-0-0.dpo", 29500)


def test_an_elastic_pod_starts_its_ranks_under_torchrun_with_fast_rendezvous_settings(env, execs):
    """The node launcher's child runs torchrun itself (accelerate's launch takes no range of machines); its ranks are
    torchrun's, deciding as ranks and applying the accelerate config in their own process."""
    env(**ELASTIC)
    argv, environment = _exec_of(lambda: launch.start("recipes/dpo.py", ["--config", ZERO3, "--max_steps", "3"]))
    assert argv[1:3] == ["-m", "trl_ext.launching.node"]
    handed = orchestrators.current()  # what the node launcher hands its child
    env(**{orchestrators.NODE_ENV: handed.to_env(), decision.LAUNCH_ENV: environment[decision.LAUNCH_ENV]})
    argv, environment = _exec_of(lambda: launch.start("recipes/dpo.py", ["--config", ZERO3, "--max_steps", "3"]))
    assert argv[1:3] == ["-m", "trl_ext.launching.elastic"] and "--first-round-last-call" not in argv  # the job's own
    options = dict(zip(argv, argv[1:]))
    assert (options["--nnodes"], options["--nproc-per-node"], options["--rdzv-backend"], options["--rdzv-endpoint"],
            options["--rdzv-id"], options["--max-restarts"]) == ("1:4", "2", "c10d", "dpo-worker-0:23456",
                                                                 "k8s-dpo-worker-0", "5")
    # trl_ext's settings, the job's own last_call_timeout in place of trl_ext's
    assert options["--rdzv-conf"] == "join_timeout=600,last_call_timeout=10,keep_alive_interval=1"
    assert argv[-5:] == ["recipes/dpo.py", "--config", ZERO3, "--max_steps", "3"]
    assert environment["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and decision.LAUNCH_ENV not in environment
    assert not any(name.startswith("PET_") and name != "PET_SIGNALS_TO_HANDLE" for name in environment)
    # without settings of the job's own: trl_ext's, and TRL_EXT_MAX_FAILURES bounds the restarts
    env(**{orchestrators.NODE_ENV: replace(handed, rendezvous_conf="", max_restarts=None).to_env()})
    argv, _ = _exec_of(lambda: launch.start("recipes/dpo.py", ["--config", ZERO3]))
    options = dict(zip(argv, argv[1:]))
    assert (options["--rdzv-conf"], options["--max-restarts"]) == (
        "join_timeout=600,last_call_timeout=2,keep_alive_interval=1", "3")
    assert argv[1:5] == ["-m", "trl_ext.launching.elastic", "--first-round-last-call", "30"]  # torchrun's default
    # a rank torchrun starts there decides as a rank, with the config applied in its process
    env(**{**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "0"})
    env().delenv(decision.LAUNCH_ENV)
    assert launch.start("recipes/dpo.py", ["--config", ZERO3, "--max_steps", "3"]) == ["--max_steps", "3"]
    assert os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    job = orchestrators.current()
    assert job.per_rank and job.orchestrator == "Kubeflow" and job.run == "k8s-dpo-worker-0"
