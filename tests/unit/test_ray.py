"""trl_ext on Ray without a cluster: a Ray job's driver found, what a recipe decides there before anything starts
(workers, output directory, the command every worker runs), the worker group's size from the cluster's nodes and a
bounded wait for room, what ends a worker told apart (a lost node or an error of the run's own), the planned stop of a
group that grows, and that trl_ext never imports Ray unless it is used. The real cluster is in tests/ray/."""

import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest

from tests.harness import REPO
from tests.launcher_env import clean_launcher_env
from trl_ext.errors import UsageError
from trl_ext.launching import decision, launch
from trl_ext.launching.ray import cluster, failures, recipe, worker
from trl_ext.placement import orchestrators, outcome, ownership
from trl_ext.trainers.preemption import Preemption

SUBMITTED = {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(
    {"runtime_env": {}, "metadata": {"job_submission_id": "raysubmit_7Tx", "job_name": "raysubmit_7Tx"}})}
RAY_ENV = ("RAY_JOB_CONFIG_JSON_ENV_VAR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
           "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
           "SLURM_JOB_ID", "SLURM_JOBID", "PET_NNODES", "SKYPILOT_NODE_RANK", "LWS_LEADER_ADDRESS",
           orchestrators.NODE_ENV, orchestrators.RUN_ID_ENV, decision.LAUNCH_ENV)


@pytest.fixture
def env(monkeypatch):
    return clean_launcher_env(monkeypatch, RAY_ENV)


def test_a_ray_jobs_driver_is_one_process_for_the_cluster_named_by_its_submission(env):
    env(**SUBMITTED)
    job = orchestrators.current()
    assert (job.orchestrator, job.per_rank, job.run, job.label) == ("Ray", False, "ray-raysubmit_7Tx",
                                                                   "Ray run ray-raysubmit_7Tx")


def test_torchrun_inside_a_ray_job_trains_on_its_machine_as_the_jobs_run(env):
    env(**SUBMITTED, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    job = orchestrators.current()
    assert job.per_rank and job.orchestrator == "Ray" and job.run == "ray-raysubmit_7Tx"


def test_a_ray_train_worker_is_the_rank_of_the_run_it_was_handed(env):
    handed = orchestrators.Job("Ray", per_rank=False, nodes=2, node_rank=1, run="ray-r1", restart=2)
    env(**{orchestrators.NODE_ENV: handed.to_env(), "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
           "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"})
    job = orchestrators.current()
    assert job.describe() == "Ray: rank 3 of 4 on 2 machine(s), run ray-r1, restart 2"


class _Exec(Exception):
    pass


def test_a_recipe_in_a_ray_jobs_driver_hands_itself_to_trl_ext_ray_before_importing_anything(env, monkeypatch):
    env(**SUBMITTED)

    def execve(path, argv, environment):
        raise _Exec(argv)

    monkeypatch.setattr(launch.os, "execve", execve)
    argv = ["--config", "accelerate_configs/zero3.yaml", "--num_processes", "2-4", "--max_steps", "3"]
    with pytest.raises(_Exec) as replaced:
        launch.start("recipes/dpo.py", argv)
    assert replaced.value.args[0] == [sys.executable, "-m", "trl_ext.ray", "recipes/dpo.py", *argv]


def test_the_driver_decides_the_workers_the_output_directory_and_every_workers_command(env, monkeypatch, tmp_path):
    env(**SUBMITTED)
    seen = {}
    monkeypatch.setattr(recipe, "_launch", lambda task, asked: seen.update(task=task, asked=asked) or 0)
    assert recipe.main(["recipes/dpo.py", "--config", "accelerate_configs/zero3.yaml", "--num_processes", "2-4",
                        "--max_steps", "3"]) == 0
    task = seen["task"]
    out = str(REPO / "outputs" / "dpo-ray-raysubmit_7Tx")  # the recipes' default, by the run, made absolute
    assert seen["asked"] == (2, 4)
    assert (task.run, task.output_dir, task.script) == ("ray-raysubmit_7Tx", out, str(REPO / "recipes" / "dpo.py"))
    assert task.argv == ["--config", "accelerate_configs/zero3.yaml", "--max_steps", "3", "--output_dir", out]
    assert recipe.main(["recipes/sft.py", "--output_dir", str(tmp_path / "mine")]) == 0
    assert seen["asked"] is None and seen["task"].argv == [
        "--config", str(launch.DATA_PARALLEL), "--output_dir", str(tmp_path / "mine")]  # no config: data parallel
    config = tmp_path / "run.yaml"
    config.write_text(f"output_dir: {tmp_path / 'configured'}\nmax_steps: 3\n")
    assert recipe.main(["recipes/dpo.py", "--config", str(config)]) == 0
    assert seen["task"].output_dir == str(tmp_path / "configured")  # the recipe config's
    assert recipe.main(["trl-ext", "sft", "--config_file", "accelerate_configs/fsdp2.yaml", "--num_processes", "4",
                        "--", "--model_name_or_path", "m", "--output_dir", str(tmp_path / "cli")]) == 0
    assert (seen["asked"], seen["task"].module, seen["task"].argv) == ((4, 4), "trl_ext", [
        "sft", "--model_name_or_path", "m", "--config_file", "accelerate_configs/fsdp2.yaml", "--output_dir",
        str(tmp_path / "cli")])


def test_the_workers_get_the_drivers_settings_but_keep_their_nodes_memory_tier(monkeypatch):
    monkeypatch.setenv("TRL_EXT_MAX_FAILURES", "5")
    monkeypatch.setenv("TRL_EXT_MEMORY_DIR", "/driver/shm")  # each node's own: its pod's or `ray start`'s
    passed = recipe.passed_on()
    assert passed["TRL_EXT_MAX_FAILURES"] == "5" and "TRL_EXT_MEMORY_DIR" not in passed


def test_another_runs_directory_is_refused_before_anything_starts(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_text("")
    with pytest.raises(UsageError, match="already holds files from another run; nothing was changed"):
        recipe.claims(str(other), "ray-new", [])
    assert not recipe.claims(str(other), "ray-new", ["--resume_from_checkpoint", "true"])  # the ranks decide
    assert not recipe.claims(str(other), "ray-new", ["--overwrite_output_dir"])
    assert recipe.claims(str(tmp_path / "new"), "ray-new", [])
    ownership.claim(str(other), "ray-new")
    assert ownership.run_of(other) == "ray-new" and recipe.claims(str(other), "ray-new", [])  # restarted: its own


def test_trl_ext_commands_leave_placement_to_ray(env):
    env(**SUBMITTED)
    with pytest.raises(UsageError, match="--num_machines: on Ray, Ray places the workers"):
        recipe.run_trl_command("sft", ["--num_machines", "2"], [], orchestrators.current())


@pytest.mark.parametrize("text, workers", [("4", (4, 4)), ("2-4", (2, 4)), (" 2 - 8 ", (2, 8)), (None, None)])
def test_a_number_of_workers_or_a_range(text, workers):
    assert cluster.parse_workers(text) == workers


@pytest.mark.parametrize("text", ["0", "4-2", "two", "2-", "1.5"])
def test_what_is_not_a_number_of_workers(text):
    with pytest.raises(UsageError, match="--num_processes"):
        cluster.parse_workers(text)


def test_the_group_by_default_one_worker_per_gpu_else_two_per_node():
    gpus = [{"CPU": 32, "GPU": 8}, {"CPU": 32, "GPU": 8}, {"CPU": 4}]
    assert cluster.size_group(gpus, None) == cluster.Group((16, 16), {"CPU": 1, "GPU": 1}, spread=False)
    cpus = [{"CPU": 16}, {"CPU": 8}, {"CPU": 0, "memory": 1}]  # a head without CPUs for work takes none
    group = cluster.size_group(cpus, None)
    assert group == cluster.Group((4, 4), {"CPU": 4}, spread=True) and group.describe() == "4 worker(s), each 4 CPU"
    assert cluster.size_group(cpus, (2, 6)).size() == (2, 6) and cluster.size_group(cpus, (3, 3)).size() == 3


def test_room_counts_whole_workers_node_by_node():
    nodes = [{"CPU": 3, "GPU": 1}, {"CPU": 1.5, "GPU": 2}]
    assert cluster.room(nodes, {"CPU": 1, "GPU": 1}) == 2
    assert cluster.shortfall(nodes, cluster.Group((3, 4), {"CPU": 1, "GPU": 1}, spread=False)) == (
        "the Ray cluster has 2 node(s) with 4.5 CPUs, 3 GPUs: room for 2 worker(s) of 1 CPU, 1 GPU; at least 3 asked")
    assert cluster.shortfall(nodes, cluster.Group((2, 2), {"CPU": 1, "GPU": 1}, spread=False)) is None


def test_too_few_resources_are_waited_for_a_stated_time_then_refused():
    now, lines = [0.0], []
    nodes = [[{"NodeID": "a", "Alive": True, "Resources": {"CPU": 2}}]]
    group = cluster.Group((4, 4), {"CPU": 1}, spread=True)

    def sleep(seconds):
        now[0] += seconds

    with pytest.raises(UsageError) as refused:
        cluster.wait_for_room(lambda: nodes[0], group, 30, lines.append, clock=lambda: now[0], sleep=sleep)
    assert now[0] == 30 and lines == ["the Ray cluster has 1 node(s) with 2 CPUs: room for 2 worker(s) of 1 CPU; 4 "
                                      "asked: waiting up to 30 s for nodes to join (TRL_EXT_RAY_WAIT_S)"]
    assert str(refused.value).startswith("error: the Ray cluster has 1 node(s) with 2 CPUs: room for 2 worker(s)")

    def joined(seconds):  # a node joins during the wait
        sleep(seconds)
        nodes[0] = nodes[0] + [{"NodeID": "b", "Alive": True, "Resources": {"CPU": 2}}]

    now[0] = 0.0
    cluster.wait_for_room(lambda: nodes[0], group, 30, lines.append, clock=lambda: now[0], sleep=joined)
    assert now[0] == 5.0


def test_a_group_that_cannot_start_is_tried_again_for_the_stated_wait_at_the_users_start_timeout(monkeypatch):
    from trl_ext.launching.ray import group

    monkeypatch.delenv(group.START_ENV, raising=False)
    assert group.start_attempts(300) == 10 and os.environ[group.START_ENV] == "30.0"  # trl_ext's 30 s, set for Ray
    monkeypatch.setenv(group.START_ENV, "120")  # the user's: kept, and the wait holds 3 starts, not 10 of 120 s
    assert group.start_attempts(300) == 3 and os.environ[group.START_ENV] == "120"
    assert group.start_attempts(10) == 1


class _HealthCheckFailed(Exception):
    """Stands for Ray's WorkerHealthCheckFailedError: its text names the worker's node, its cause the failure."""

    def __init__(self, node: str, cause: Exception):
        super().__init__(f"A worker health check failed.\nWorker info: Worker(\n  metadata=ActorMetadata(\n"
                         f"    node_id='{node}',\n  ),\n)")
        self.health_check_failure = cause


class ActorUnavailableError(Exception):
    pass


def test_an_error_of_the_runs_own_is_told_from_a_lost_node():
    bug = failures.RankError("rank 0: ValueError: a bug", kind=outcome.ERROR)
    peer = failures.RankError("rank 1: RuntimeError: Connection closed by peer", kind=outcome.PEER)
    assert failures.verdict({0: bug, 1: bug}) == (outcome.ERROR, "rank 0: ValueError: a bug")
    assert failures.verdict({0: bug, 1: peer}) == (outcome.PEER, "rank 1: RuntimeError: Connection closed by peer")
    lost = _HealthCheckFailed("ab12", ActorUnavailableError("unreachable"))
    kind, line = failures.verdict({0: lost, 1: bug})  # a node lost decides: the others fail in every way
    assert kind == outcome.PEER and line.startswith("Ray lost rank 0's worker: _HealthCheckFailed: A worker health")
    assert failures.lost_nodes({0: lost, 1: bug}) == {"ab12"}
    assert failures.lost_nodes({0: _HealthCheckFailed("cd34", RuntimeError("died"))}) == set()  # dead, not lost


def test_every_lost_group_refreshes_rays_view_even_when_its_node_was_already_dead(monkeypatch, tmp_path):
    """With Ray's node health checks faster than the controller (1 s x 3 on a cluster), the lost node is dead before
    trl_ext's verdict runs: its workers are reported died, not unreachable, so no node is waited for; the view is
    refreshed all the same, or the next group is sized for the dead node and waits out a whole start timeout
    (measured: 30 s, bench/on_ray.py --health-check-ms 1000, 2026-12-03)."""
    pytest.importorskip("ray.train")
    from trl_ext.launching.ray import controller

    refreshed, waited, reported = [], [], []
    monkeypatch.setattr(controller.cluster, "refresh_view", lambda say: refreshed.append(True))
    monkeypatch.setattr(controller, "_marked_dead", lambda nodes, seconds: waited.append(nodes) or True)
    monkeypatch.setattr(controller.node_death, "report_dead", lambda nodes, say: reported.append(nodes))
    verdict = controller.Verdict("ray-run", str(tmp_path), limit=3)
    verdict.after_exception(None, {2: _HealthCheckFailed("cd34", RuntimeError("died"))})  # dead already
    assert (refreshed, waited, reported) == ([True], [], [])
    verdict.after_exception(None, {2: _HealthCheckFailed("ab12", ActorUnavailableError("unreachable"))})
    # reported dead where its raylet is gone (tests/unit/test_ray_node_death.py), then seen dead, then the view
    assert (refreshed, waited, reported) == ([True, True], [{"ab12"}], [{"ab12"}])


def test_what_ends_a_rank_keeps_its_kind_across_processes():
    import pickle

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:10448")
    for exc, kind, line in [
            (ValueError("a bug at step 5"), outcome.ERROR, "rank 2: ValueError: a bug at step 5"),
            (gloo, outcome.PEER, f"rank 2: RuntimeError: {gloo}"),
            (UsageError("--max_steps 'x' is not a number"), outcome.ERROR,
             "rank 2: error: --max_steps 'x' is not a number")]:
        failure = pickle.loads(pickle.dumps(worker._failure(exc, 2)))
        assert (type(failure), failure.kind, str(failure)) == (failures.RankError, kind, line)


def test_a_group_grows_only_to_a_size_that_keeps_the_global_batch():
    from trl_ext.launching.ray.growth import keeps_global_batch

    assert keeps_global_batch(2, 2, 4)  # after a loss from 4: two batches accumulated, halved again
    assert not keeps_global_batch(2, 1, 4)  # started on 2: 8 samples cannot be 4 x 4
    assert not keeps_global_batch(2, 2, 3) and keeps_global_batch(3, 2, 6)


def test_a_planned_stop_is_a_sigterm_with_a_reason():
    stop = Preemption()
    stop.request_stop("Ray: room for 2 more worker(s)")
    args = type("Args", (), {"process_index": 0, "device": "cpu"})()
    assert stop._decide(args, type("State", (), {"global_step": 5, "max_steps": 10})()) == signal.SIGTERM
    assert stop.reason == "Ray: room for 2 more worker(s)"


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")
def test_no_cluster_at_an_address_is_said_within_the_stated_time():
    import time

    from trl_ext.launching.launch import free_port
    from trl_ext.launching.ray import group

    started = time.monotonic()
    with pytest.raises(UsageError, match=r"no Ray cluster at 127\.0\.0\.1:\d+: nothing answered there within 1 s"):
        group.connect(f"127.0.0.1:{free_port()}", seconds=1)
    assert time.monotonic() - started < 10


def test_trl_ext_never_imports_ray_unless_it_is_used():
    """No module of trl_ext imports Ray when it is imported (only trl_ext/launching/ray/controller.py, which only Ray's
    controller imports); a recipe's launch outside Ray imports none, trl_ext.ray's own package included."""
    import ast

    top_level = []
    for path in (REPO / "trl_ext").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if (
                isinstance(node, ast.ImportFrom) and node.level == 0) else []
            if any(n == "ray" or n.startswith("ray.") for n in names):
                top_level.append(str(path.relative_to(REPO)))
    assert sorted(set(top_level)) == ["trl_ext/launching/ray/controller.py"]
    code = ("import sys, trl_ext, trl_ext.ray, trl_ext.launching.ray.recipe, trl_ext.launching.ray.group\n"
            "import trl_ext.launching.launch as launch, trl_ext.placement.orchestrators as o\n"
            "o.current(); launch.start('recipes/dpo.py', ['--max_steps', '3'])\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


# Standby processes (trl_ext.launching.ray.standby): the node's directory of slots and spares, without a cluster.

@pytest.fixture
def spares(monkeypatch, tmp_path):
    """The standby directory at ``tmp_path``, on; the raylet's prestart recorded instead of asked."""
    from trl_ext.launching.ray import standby

    monkeypatch.setattr(standby, "_directory", lambda: tmp_path)
    monkeypatch.setenv(standby.HOOK_ENV, standby.HOOK)  # the driver turned them on
    asked = []
    monkeypatch.setattr(standby, "_prestart", asked.append)
    return standby, tmp_path, asked


def _preload_in_child(standby, niceness_file) -> None:
    """``preload`` in a forked child (its own process id, as each spare has), waited for; the child's niceness after
    it (its main thread's, which runs the rank) written to ``niceness_file``."""
    import multiprocessing

    def spare():
        standby.preload()
        niceness_file.write_text(str(os.getpriority(os.PRIO_PROCESS, 0)))

    child = multiprocessing.get_context("fork").Process(target=spare)
    child.start()
    child.join(60)
    assert child.exitcode == 0


def test_each_slot_makes_one_spare_that_imports_what_the_rank_had_and_other_processes_import_nothing(
        spares, monkeypatch, tmp_path_factory):
    standby, directory, asked = spares
    said = []
    assert standby.keep_ready(2, gpu=False, say=said.append) == 2
    assert asked == [2] and "2 standby process(es) on this node" in said[0]
    slots = sorted(directory.glob("slot-*"))
    assert len(slots) == 2 and slots[0].read_text().split() == standby.imported()
    # a module that says which process imported it, and one that fails, in place of the rank's list
    code = tmp_path_factory.mktemp("modules")
    (code / "standby_probe.py").write_text(  # the importing thread's niceness, in a file named by the process
        f"import os, threading\nopen(os.path.join({str(code)!r}, str(os.getpid())), 'w').write("
        "str(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))\n")
    (code / "standby_broken.py").write_text("raise RuntimeError('no')\n")
    monkeypatch.syspath_prepend(str(code))
    for slot in slots:
        slot.write_text("standby_probe\nstandby_broken\n")
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    for _ in range(3):  # the third process finds no slot: an ordinary worker, which imports nothing
        _preload_in_child(standby, code / "after")
        assert (code / "after").read_text() == str(mine)  # the rank it becomes runs at this process's priority
    claimed = sorted(directory.glob("spare-*"))
    assert not list(directory.glob("slot-*")) and len(claimed) == 2
    imported = {p.name: p.read_text() for p in code.iterdir() if p.name.isdigit()}
    assert sorted(imported) == sorted(p.name[6:] for p in claimed)
    assert set(imported.values()) == {str(mine)}  # at a worker's priority: a restart never waits on a slower import
    for spare in claimed:
        seconds, failed = spare.read_text().split()
        assert float(seconds) >= 0 and failed == "1"


def test_spares_still_waiting_are_counted_dead_ones_and_stale_slots_dropped_and_gpu_groups_preload_torch(spares):
    standby, directory, asked = spares
    (directory / f"spare-{os.getpid()}").write_text("4.0 0")  # waiting
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (directory / f"spare-{dead.pid}").write_text("4.0 0")
    (directory / "slot-1-0").write_text("torch")  # asked for by a group that is gone, never claimed
    assert standby.keep_ready(3, gpu=True, say=lambda line: None) == 2
    assert asked == [2]
    assert not (directory / f"spare-{dead.pid}").exists() and not (directory / "slot-1-0").exists()
    slots = list(directory.glob("slot-*"))
    assert len(slots) == 2 and {s.read_text() for s in slots} == {"torch"}
    assert standby.keep_ready(1, gpu=True, say=lambda line: None) == 0  # the waiting one is enough


def test_a_process_that_was_a_spare_says_so_once_and_preload_never_raises(spares, monkeypatch):
    standby, directory, _ = spares
    assert standby.taken() is None
    (directory / f"spare-{os.getpid()}").write_text("6.5 1")
    assert standby.taken() == 6.5
    assert standby.taken() is None
    monkeypatch.setattr(standby, "_directory", lambda: directory / "missing")
    standby.preload()  # nothing to claim, nothing raised
    monkeypatch.setattr(standby, "_claim", lambda: 1 / 0)
    standby.preload()  # Ray would end a worker whose hook raised


def test_a_worker_asks_for_no_spares_unless_the_driver_set_the_hook(spares, monkeypatch):
    standby, directory, asked = spares
    monkeypatch.delenv(standby.HOOK_ENV)
    assert standby.keep_ready(2, False, print) == 0 and asked == [] and not list(directory.iterdir())
    monkeypatch.setenv(standby.HOOK_ENV, "users_own.hook")
    assert standby.keep_ready(2, False, print) == 0 and asked == []


def test_a_failed_prestart_is_one_line_and_the_group_restarts_as_without_spares(spares, monkeypatch):
    standby, _, _ = spares

    def refuse(count):
        raise ConnectionError("raylet gone")

    monkeypatch.setattr(standby, "_prestart", refuse)
    said = []
    assert standby.keep_ready(2, gpu=False, say=said.append) == 0
    assert said == ["Ray: could not ask this node's raylet for standby processes (ConnectionError: raylet gone)"]


def test_standby_processes_are_off_when_asked_or_where_the_job_has_a_setup_hook_of_its_own(monkeypatch):
    pytest.importorskip("ray")
    from trl_ext.launching.ray import standby

    monkeypatch.delenv(standby.HOOK_ENV, raising=False)
    monkeypatch.delenv("TRL_EXT_RAY_STANDBY", raising=False)
    assert standby.worker_env() == {standby.HOOK_ENV: "trl_ext.launching.ray.standby.preload"}
    monkeypatch.setenv("TRL_EXT_RAY_STANDBY", "0")
    assert standby.worker_env() == {}
    monkeypatch.setenv("TRL_EXT_RAY_STANDBY", "yes")
    with pytest.raises(UsageError, match="TRL_EXT_RAY_STANDBY='yes' is not a whole number from 0 to 1"):
        standby.worker_env()
    monkeypatch.setenv("TRL_EXT_RAY_STANDBY", "1")
    monkeypatch.setenv(standby.HOOK_ENV, "users_own.hook")
    assert standby.worker_env() == {}


def test_the_hooks_module_imports_neither_torch_nor_transformers():
    """Ray imports it in every new worker of the group: only a spare may import more."""
    code = ("import sys, trl_ext.launching.ray.standby\n"
            "print(sorted(m for m in ('torch', 'transformers', 'trl', 'ray') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
