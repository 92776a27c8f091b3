"""placement/failure_limit.py: restarts bounded by one rule of the run's own under every orchestrator (failed attempts
in a row without a new checkpoint), with its record in the output directory and on the mirror."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from trl_ext.launching import node, restart
from trl_ext.placement import failure_limit, orchestrators, outcome, ownership
from trl_ext.settings import environment

REPO = Path(__file__).resolve().parents[2]
ATTEMPT = REPO / "tests" / "scripts" / "attempt.py"
KUBEFLOW = {"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "dpo-node-0-0.dpo", "PET_MASTER_PORT": "29500"}
# Each orchestrator's variables as one machine of a run sees them; none of them counts its restarts for the run.
ORCHESTRATORS = {
    "SkyPilot": {"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2", "SKYPILOT_NUM_NODES": "2",
                 "SKYPILOT_TASK_ID": "sky-managed-2026_dpo_3-0"},
    "JobSet": {**KUBEFLOW, "PET_MASTER_ADDR": "dpo-trainer-0-0.dpo", "JOBSET_NAME": "dpo"},
    "Kubeflow": KUBEFLOW,
    "LeaderWorkerSet": {"LWS_LEADER_ADDRESS": "dpo-0.dpo.default", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0"},
}
CLEARED = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
           "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE", "SLURM_JOB_ID", "SLURM_JOBID",
           "SLURM_RESTART_COUNT", "SLURM_NODEID", "RAY_JOB_SUBMISSION_ID", orchestrators.NODE_ENV,
           orchestrators.RUN_ID_ENV, ownership.RUN_ENV, environment.MAX_FAILURES.name, *environment.MAX_FAILURES.former,
           *{k for v in ORCHESTRATORS.values() for k in v}}


@pytest.fixture
def as_process(monkeypatch):
    """This test process as a fresh process of a run under an orchestrator: ``start(variables)`` again for each
    attempt (what one process remembers is forgotten)."""
    for key in CLEARED:
        monkeypatch.delenv(key, raising=False)

    def start(variables: dict) -> None:
        for key, value in variables.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(failure_limit, "_begun", set())
        monkeypatch.setattr(ownership, "claimed_here", set())

    return start


def test_how_the_attempt_before_ended_counts():
    count = failure_limit.next_count
    assert count({}, 0) == (1, "failed")
    assert count({"failures": 2, "checkpoint": 40}, 40) == (3, "failed")  # no new checkpoint: one more in a row
    assert count({"failures": 2, "checkpoint": 40}, 60) == (1, "failed")  # after progress: the first in a row
    assert count({"failures": 2, "checkpoint": 40, "stopped": True}, 40) == (2, "stopped")  # a preemption: none
    assert count({"failures": 2, "checkpoint": 40, "stopped": True}, 60) == (0, "stopped")
    assert count({"failures": 4, "checkpoint": 40, "gave_up": True}, 40) == (0, "restarted by hand")


def test_the_one_setting_and_its_former_names(monkeypatch):
    for name in (environment.MAX_FAILURES.name, *environment.MAX_FAILURES.former):
        monkeypatch.delenv(name, raising=False)
    assert (failure_limit.max_failures(), failure_limit.setting()) == (3, "TRL_EXT_MAX_FAILURES")
    monkeypatch.setenv("TRL_EXT_SLURM_MAX_FAILURES", "5")
    assert (failure_limit.max_failures(), failure_limit.setting()) == (5, "TRL_EXT_SLURM_MAX_FAILURES")
    monkeypatch.setenv("TRL_EXT_MAX_FAILURES", "0")
    assert (failure_limit.max_failures(), failure_limit.setting()) == (0, "TRL_EXT_MAX_FAILURES")


def test_under_ray_each_lost_group_counts_by_the_same_rule_and_a_person_starts_it_again(tmp_path):
    """Ray restarts a run's worker group itself, within one attempt: the controller counts each lost group in the
    run's record, as ``begin`` counts an attempt; a new checkpoint starts the count again."""
    out = tmp_path / "out"
    ownership.claim(out, "ray-run")
    (out / "checkpoint-5").mkdir()
    assert failure_limit.count_lost_group(out, 1) == (1, 5, False)  # the first in a row
    (out / "checkpoint-10").mkdir()
    assert failure_limit.count_lost_group(out, 1) == (1, 10, False)  # after progress: the first again
    assert failure_limit.count_lost_group(out, 1) == (2, 10, True)  # the second in a row: over the limit
    assert ownership.record(out)["gave_up"] is True
    line = failure_limit.gave_up_line("Ray run r", 2, 10, 1, "the run ends")
    assert line.startswith("Ray run r: 2 failed attempts in a row without a new checkpoint (newest: checkpoint-10); "
                           "the limit is 1 (TRL_EXT_MAX_FAILURES), so the run ends (exit "
                           "202)") and "\n" not in line
    failure_limit.started_by_hand(out, "ray-run")  # the driver of a run started again by a person
    assert (ownership.record(out)["failures"], ownership.record(out)["gave_up"]) == (0, False)
    assert failure_limit.count_lost_group(out, 1) == (1, 10, False)


def test_a_run_gives_up_after_too_many_failures_in_a_row_and_a_person_starts_it_again(as_process, tmp_path, capfd):
    out = tmp_path / "out"
    as_process(ORCHESTRATORS["SkyPilot"])
    failure_limit.begin(out, limit=1)  # the first attempt: nothing to count, nothing written
    ownership.claim(out)
    assert ownership.record(out) == {"run": "skypilot-sky-managed-2026_dpo_3-0", "attempts": 1}
    as_process({})  # the first attempt failed; the orchestrator starts the second
    failure_limit.begin(out, limit=1)
    assert "attempt 2: the attempt before it did not finish (1 failed attempt(s) in a row" in capfd.readouterr().err
    as_process({})
    with pytest.raises(failure_limit.GaveUp) as gave_up:
        failure_limit.begin(out, limit=1)
    assert gave_up.value.code == failure_limit.GAVE_UP == 202 and gave_up.value.kind == outcome.GAVE_UP
    line = capfd.readouterr().err
    assert ("SkyPilot run skypilot-sky-managed-2026_dpo_3-0: 2 failed attempts in a row without a new checkpoint "
            "(newest: no checkpoint yet); the limit is 1 (TRL_EXT_MAX_FAILURES), so this attempt stops (exit 202)"
            in line)
    assert line.count("\n") == 1  # one line
    assert ownership.record(out)["gave_up"] and ownership.record(out)["attempts"] == 3
    as_process({})  # no orchestrator restarts 202: a person started it again
    failure_limit.begin(out, limit=1)
    assert "attempt 4: started again after it gave up: failures are counted from 0" in capfd.readouterr().err
    assert ownership.record(out)["failures"] == 0 and not ownership.record(out)["gave_up"]


def test_a_run_that_commits_a_checkpoint_between_failures_goes_on(as_process, tmp_path):
    out = tmp_path / "out"
    as_process(ORCHESTRATORS["LeaderWorkerSet"])
    ownership.claim(out)
    for step in range(1, 6):  # five failures, each after a new checkpoint
        (out / f"checkpoint-{step}").mkdir()
        as_process({})
        failure_limit.begin(out, limit=1)
        assert ownership.record(out)["failures"] == 1
    failure_limit.stopped(out)  # a preemption, with a checkpoint
    (out / "checkpoint-6").mkdir()
    as_process({})
    failure_limit.begin(out, limit=1)
    assert ownership.record(out)["failures"] == 0 and ownership.record(out)["attempts"] == 7


def test_a_run_that_commits_a_memory_checkpoint_between_failures_goes_on(as_process, tmp_path, monkeypatch):
    """Lost machines every few memory checkpoints, no new disk checkpoint between them: each attempt resumed from
    memory and took newer ones, which count as progress (the trainer passes the memory tier's newest step on)."""
    from trl_ext.mirror import run_record
    from trl_ext.saving.memory_tier import MemoryTier

    out = tmp_path / "out"
    monkeypatch.setenv("TRL_EXT_MEMORY_DIR", str(tmp_path / "shm"))
    as_process(ORCHESTRATORS["Kubeflow"])
    ownership.claim(out)
    tier = MemoryTier.of(SimpleNamespace(output_dir=str(out), memory_checkpoint_steps=2))
    tier.share_token(SimpleNamespace(output_dir=str(out)), create=True)
    tier.begin(None)
    for step in (2, 4, 6, 8):  # four failures, each after a newer memory checkpoint
        checkpoint = tier.root / f"checkpoint-{step}"
        checkpoint.mkdir()
        tier.committed(checkpoint, step)
        as_process({})
        run_record.begin_attempt(None, out, tier.newest_step())
        assert ownership.record(out)["failures"] == 1 and tier.newest_step() == step
    (tier.root / "checkpoint-10").mkdir()  # its manifest never written: not committed, so no progress
    as_process({})
    run_record.begin_attempt(None, out, tier.newest_step())
    assert ownership.record(out)["failures"] == 2


def test_slurm_and_ray_count_where_they_restart_and_a_new_torchrun_launch_starts_from_0(as_process, tmp_path):
    out = tmp_path / "out"
    as_process({"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"})
    ownership.claim(out)
    ownership.update(out, failures=9)
    as_process({"SLURM_RESTART_COUNT": "3"})
    failure_limit.begin(out, limit=1)  # the batch script's decision (restart.decide), not the attempt's
    assert ownership.record(out)["failures"] == 9
    torchrun = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "TORCHELASTIC_RUN_ID": "job7", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}
    out = tmp_path / "elastic"
    as_process({**torchrun, "SLURM_JOB_ID": ""})
    os.environ.pop("SLURM_JOB_ID")
    ownership.claim(out)
    ownership.update(out, failures=9)
    as_process({"TORCHELASTIC_RESTART_COUNT": "1"})  # torchrun's restart: counted
    with pytest.raises(failure_limit.GaveUp):
        failure_limit.begin(out, limit=3)
    as_process({"TORCHELASTIC_RESTART_COUNT": "0"})  # a new launch of torchrun with the same --rdzv-id
    failure_limit.begin(out, limit=3)
    assert ownership.record(out)["failures"] == 0


def test_the_node_launcher_ends_with_202_when_its_ranks_gave_up(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(ownership.RUN_ENV, str(tmp_path))
    error = failure_limit.GaveUp("SkyPilot run r: 4 failed attempts in a row", quiet=True)  # as another rank has it
    outcome.record(error)  # what every rank does with it (the trainer's constructor)
    assert [f["kind"] for f in outcome.failures(tmp_path)] == [outcome.GAVE_UP] and not capfd.readouterr().err
    code, line = node.ending(str(tmp_path), 1)  # torchrun's own code for a failed rank is 1
    assert (code, line) == (202, "SkyPilot run r: 4 failed attempts in a row")
    import pickle

    assert pickle.loads(pickle.dumps(error)).code == 202  # raised on the other ranks too (decided_on_rank0)


def test_slurm_applies_the_same_rule_with_the_same_setting(tmp_path, monkeypatch, as_process):
    as_process({"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0",
                environment.MAX_FAILURES.name: "1"})
    out, run = tmp_path / "out", tmp_path / "run"
    run.mkdir()
    ownership.claim(out)
    (run / ownership.OUTPUT_DIR_NOTE).write_text(str(out))
    assert restart.decide(restart.LOST, run_dir=str(run)).action == restart.REQUEUE
    decision = restart.decide(restart.LOST, run_dir=str(run))
    assert decision.action == restart.FAILED and "the limit is 1, TRL_EXT_MAX_FAILURES" in decision.line


@pytest.mark.parametrize("orchestrator", list(ORCHESTRATORS))
def test_every_orchestrators_restarts_end_in_202_after_the_limit(orchestrator, tmp_path):
    """Real processes, as the orchestrator starts them: each attempt loses a peer (exit 200, which every example's
    policy restarts) until the third in a row without a new checkpoint, whose next attempt ends with 202."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(ORCHESTRATORS[orchestrator], TRL_EXT_MAX_FAILURES="2", PYTHONPATH=str(REPO))
    out, codes, progress = tmp_path / "out", [], ["", "5", "", "", "", ""]  # checkpoint-5 in the second attempt
    for step in progress:
        done = subprocess.run([sys.executable, str(ATTEMPT), str(out), "200", *([step] if step else [])], env=env,
                              capture_output=True, text=True, timeout=120)
        codes.append(done.returncode)
        if done.returncode != 200:
            break
    assert codes == [200, 200, 200, 200, 202], done.stderr  # attempts 3 and 4 fail without progress after checkpoint-5
    assert "3 failed attempts in a row without a new checkpoint (newest: checkpoint-5); the limit is 2" in done.stderr
    assert json.loads((out / ownership.RUN_MARKER).read_text())["attempts"] == 5


def test_the_count_survives_a_recovery_onto_an_empty_disk_through_the_mirror(as_process, tmp_path):
    from trl_ext.files import manifest
    from trl_ext.mirror import run_record
    from trl_ext.mirror.store import Store

    (tmp_path / "bucket").mkdir()
    store = Store(f"file://{tmp_path / 'bucket'}")
    as_process(ORCHESTRATORS["SkyPilot"])
    first = tmp_path / "vm1"
    ownership.claim(first)  # the recipe claims the new disk, then the trainer begins the attempt
    run_record.begin_attempt(store, first)
    assert store.read_json(run_record.NAME) == {"run": "skypilot-sky-managed-2026_dpo_3-0", "attempts": 1}
    for attempt, disk in enumerate(["vm2", "vm3"], start=2):  # each recovery on new VMs, empty disks
        as_process({})
        ownership.claim(tmp_path / disk)
        run_record.begin_attempt(store, tmp_path / disk)
        assert store.read_json(run_record.NAME)["attempts"] == attempt
    assert store.read_json(run_record.NAME)["failures"] == 2
    as_process({environment.MAX_FAILURES.name: "2"})
    ownership.claim(tmp_path / "vm4")
    with pytest.raises(failure_limit.GaveUp):
        run_record.begin_attempt(store, tmp_path / "vm4")
    assert store.read_json(run_record.NAME)["gave_up"]  # kept on the mirror: a person's restart counts from 0
    (tmp_path / "bucket" / "checkpoint-8").mkdir(parents=True)  # a complete mirrored checkpoint: progress
    (tmp_path / "bucket" / "checkpoint-8" / manifest.NAME).write_text("{}")
    as_process({})
    ownership.claim(tmp_path / "vm5")
    run_record.begin_attempt(store, tmp_path / "vm5")
    assert store.read_json(run_record.NAME)["checkpoint"] == 8


def test_a_store_that_fails_costs_the_copy_not_the_run(as_process, tmp_path, caplog):
    from trl_ext.mirror import run_record

    class Down:
        def read_json(self, rel):
            raise ConnectionError("Could not connect to the endpoint URL")

        write_json = complete = read_json

    as_process(ORCHESTRATORS["SkyPilot"])
    out = tmp_path / "out"
    ownership.claim(out)
    as_process({})
    run_record.begin_attempt(Down(), out)  # counted on disk all the same
    assert ownership.record(out)["attempts"] == 2
    said = [r.getMessage() for r in caplog.records if "run's record" in r.getMessage()]
    assert len(said) == 2 and "could not read" in said[0] and "could not write" in said[1], said
