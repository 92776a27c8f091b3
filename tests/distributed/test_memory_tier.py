"""The memory tier under real launches.

- One machine: a recipe as users start it (``python recipes/dpo.py --config accelerate_configs/zero3.yaml``, then
  FSDP2) with ``--memory_checkpoint_steps 2`` and a disk checkpoint every 10 steps. One rank is SIGKILLed once memory
  checkpoint-12 is committed (during step 13); the launch restarts its ranks, which resume from step 12 in memory,
  without reading the disk's checkpoint-10 (made unreadable after the kill), and the run completes with its final save
  verified.
- Two machines, as Kubernetes restarts a run: two pods with Kubeflow's ``PET_*`` variables and a JobSet's name, the
  recipe as their command, each its own ``TRL_EXT_MEMORY_DIR``; memory checkpoints every 2 steps, none on disk before
  the end. Once memory checkpoint-12 is replicated, the second pod's processes are all killed and its memory deleted
  (a new node); the first pod ends on its own; both are started again with the same command, as JobSet recreates
  pods. The run resumes from step 12 in memory at world size 2: the new machine receives its part from the first
  machine's replica.
- Elastic torchrun (``--nnodes 1:2``): the second machine is lost; the first resumes alone from step 12 in its memory,
  which holds its replica of the lost machine's part, at world size 1. Started by trl_ext in pods, the lost pod is
  then recreated on a new node and joins the running job: the survivor's ranks are restarted, and the world of 2
  resumes from memory checkpoint-14, which the survivor took alone, given whole to the new machine.

The one-process cases are in tests/unit/test_memory_tier.py."""

import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.harness import run_command
from tests.machines import ELASTIC_ENV, TORCHRUN, Machine, free_ports, rank_process, wait_for_port
from trl_ext.files.audit import audit
from trl_ext.saving import memory_tier

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TRAINING = ["--max_steps", "16", "--save_strategy", "steps", "--save_steps", "10", "--memory_checkpoint_steps", "2",
            "--logging_steps", "1", "--eval_strategy", "no", "--eval_on_start", "false"]


class KillOnceCommitted(threading.Thread):
    """SIGKILLs global rank 1 as soon as memory checkpoint ``step``'s manifest is in place, then damages the disk's
    newest checkpoint so that a resume that read it would fail."""

    def __init__(self, memory_dir: Path, out: Path, step: int, disk_step: int):
        super().__init__(daemon=True)
        self.memory_dir, self.out, self.step, self.disk_step = memory_dir, out, step, disk_step
        self.launcher: int | None = None  # set by watch()
        self.killed: str | None = None

    def watch(self, launcher) -> None:
        """Start watching, the launcher's process known (``run_command``'s ``on_start``)."""
        self.launcher = launcher.pid
        self.start()

    def run(self):
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and self.killed is None:
            if any(self.memory_dir.glob(f"*/.checkpoint-{self.step}.manifest.json")):
                victim = rank_process(self.launcher, 1)
                if victim is not None:
                    os.kill(victim.pid, signal.SIGKILL)
                    self.killed = f"rank 1 (pid {victim.pid})"
                    for path in (self.out / f"checkpoint-{self.disk_step}").rglob("*"):
                        if path.is_file():
                            path.write_bytes(b"")  # a resume that read it would fail
            time.sleep(0.02)


@pytest.mark.parametrize("config", ["zero3", "fsdp2"])
def test_a_rank_killed_on_one_machine_restarts_and_resumes_from_memory(config, tmp_path):
    out, memory_dir = tmp_path / "dpo", tmp_path / "shm"
    cmd = [sys.executable, "recipes/dpo.py", "--config", f"accelerate_configs/{config}.yaml", "--output_dir", str(out),
           *TRAINING]
    killer = KillOnceCommitted(memory_dir, out, step=12, disk_step=10)
    result = run_command(cmd, 780, {"HF_HOME": str(tmp_path / "hf"), "TRL_EXT_MEMORY_DIR": str(memory_dir)},
                         on_start=killer.watch)
    (tmp_path / "output.log").write_text(result.output)
    assert killer.killed, result.output[-4000:]
    assert not result.timed_out and result.returncode == 0, result.output[-6000:]
    assert "a lost rank restarts them (at most 3 times, TRL_EXT_MAX_FAILURES), resuming from memory" in result.output
    root = next(memory_dir.iterdir(), None) if memory_dir.is_dir() else None
    resumed = [line for line in result.output.splitlines() if "resuming from step" in line]
    assert len(resumed) == 1 and "restart 1: resuming from step 12 in memory (" in resumed[0] and \
        "the newest on disk is checkpoint-10" in resumed[0], resumed or result.output[-4000:]
    assert f"saved and verified: {out}" in result.output
    assert audit(str(out), base=None).ok
    assert root is None, "the completed run kept its memory checkpoints"
    assert memory_tier.TOKEN in {p.name for p in out.iterdir()}


def _held(tmp: Path) -> dict[str, str]:
    """The DPO recipe with training step 14 held until the test releases it (tests/slurm/slowed.py): the kill comes
    while memory checkpoint-12 is the newest, whatever this machine's speed."""
    (tmp / "hold").mkdir(exist_ok=True)
    return {"TRL_EXT_TEST_RECIPE": "recipes/dpo.py", "TRL_EXT_TEST_HOLD": "step-14",
            "TRL_EXT_TEST_HOLD_DIR": str(tmp / "hold")}


def _release(tmp: Path) -> None:
    (tmp / "hold" / "release-step-14").touch()


def _pods(tmp: Path, out: Path, config: str, port: int, held: bool) -> list[Machine]:
    """Two Kubeflow pods of one JobSet, one process each, the DPO recipe as their command, each its own memory."""
    script = "tests/slurm/slowed.py" if held else "recipes/dpo.py"
    cmd = [sys.executable, script, "--config", f"accelerate_configs/{config}.yaml", "--config",
           "recipes/configs/dpo.yaml", "--output_dir", str(out), *TRAINING_ON_PODS]
    return [Machine(f"pod-{rank}", cmd,
                    {"PET_NNODES": "2", "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": "1",
                     "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port), "JOBSET_NAME": "dpo-memory",
                     "HF_HOME": str(tmp / "hf"), "TRL_EXT_MEMORY_DIR": str(tmp / f"shm-{rank}"),
                     **(_held(tmp) if held else {})},
                    tmp / f"pod-{rank}.log" if held else tmp / f"pod-{rank}-again.log")
            for rank in (0, 1)]


TRAINING_ON_PODS = [*TRAINING[:TRAINING.index("--save_steps")], "--save_steps", "20",
                    *TRAINING[TRAINING.index("--save_steps") + 2:]]  # no disk checkpoint before the final save


def _replicated(tmp: Path, step: int) -> bool:
    """Whether memory checkpoint ``step`` counts on both pods (its manifest is written once its replica is)."""
    return all(any((tmp / f"shm-{rank}").glob(f"*/.checkpoint-{step}.manifest.json")) for rank in (0, 1))


def _wait_until_replicated(tmp: Path, step: int, machines: list[Machine]) -> None:
    deadline = time.monotonic() + 600
    while not _replicated(tmp, step) and time.monotonic() < deadline and all(m.proc.poll() is None for m in machines):
        time.sleep(0.02)
    assert _replicated(tmp, step), "\n".join(m.output[-3000:] for m in machines)


@pytest.mark.parametrize("config", ["zero3", "fsdp2"])
def test_a_lost_pod_recreated_on_a_new_node_resumes_from_its_peers_replica(config, tmp_path):
    out, port = tmp_path / "dpo", free_ports()
    pods = _pods(tmp_path, out, config, port, held=True)
    _wait_until_replicated(tmp_path, 12, pods)
    pods[1].die()
    shutil.rmtree(tmp_path / "shm-1")  # a new node: its memory is gone
    _release(tmp_path)  # pod 0 takes step 14 and finds its peer gone
    assert pods[0].wait(300) != 0, pods[0].output[-3000:]  # its peer is lost: it ends, as today
    again = _pods(tmp_path, out, config, port, held=False)  # JobSet recreates both pods
    codes = [pod.wait(600) for pod in again]
    log = again[0].output
    assert codes == [0, 0], "\n".join(p.output[-4000:] for p in again)
    resumed = [line for line in log.splitlines() if "resuming from step" in line]
    assert len(resumed) == 1 and "resuming from step 12 in memory (" in resumed[0] and \
        "none is on disk" in resumed[0], resumed or log[-4000:]
    assert ("memory checkpoint-12 (taken on 2 machines, resumed on 2): machine 1 received the parts of machines 0 and "
            "1 from machine 0") in log, log[-4000:]
    assert "memory_checkpoint_steps=2: a checkpoint in memory every 2 steps" in log and \
        "the previous machine's replica" in log, log[-4000:]
    assert f"saved and verified: {out}" in log
    assert audit(str(out), base=None).ok


def _rejoin(machines: list[Machine], tmp: Path, lost: float) -> None:
    """The lost pod, recreated on a new node (an empty memory tier), joins while the survivor's restarted ranks are
    held at step 15: torchrun restarts them (held, they outlast its 30 s after SIGTERM and are killed, so no
    preemption checkpoint is saved), and the grown world of 2 resumes from memory checkpoint-14, which the survivor
    took alone. The new pod's ranks (its restart 0) are held at step 15 too, until both are there."""
    machines[0].when(r"\[test\] holding step-15", 600, after=lost)
    cmd, env = machines[1].cmd, {**machines[1].env, "TRL_EXT_MEMORY_DIR": str(tmp / "shm-1-new")}
    machines[1] = Machine("machine-1-new", cmd, env, tmp / "machine-1-new.log")
    machines[0].when(r"resuming from step 14 in memory", 600, after=lost)
    (tmp / "hold" / "release-step-15").touch()
    assert machines[1].wait(600) == 0, machines[1].output[-6000:]


@pytest.mark.parametrize("started", ["torchrun", "pods"])
def test_elastic_torchrun_left_with_one_machine_resumes_from_memory_alone(started, tmp_path):
    """Elastic torchrun (``--nnodes 1:2``), started as docs/launchers.md shows (``torchrun``) or by trl_ext in pods
    whose command is the recipe, with a PyTorchJob's elastic variables and no rendezvous setting of their own
    (``pods``): the second machine is lost once memory checkpoint-12 is replicated; the first resumes by itself from
    step 12 in its memory (its own part and its replica of the lost machine's) at world size 1, and completes. In
    pods, the lost pod comes back first (``_rejoin``), and the run ends on 2 machines."""
    out, port = tmp_path / "dpo", free_ports()
    args = ["--config", "accelerate_configs/zero3.yaml", "--config", "recipes/configs/dpo.yaml", "--output_dir",
            str(out), *TRAINING_ON_PODS]
    if started == "torchrun":
        cmd = [*TORCHRUN, "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-memory", "--rdzv-conf",
               "last_call_timeout=2", "tests/slurm/slowed.py", *args]
    else:  # training-operator's elastic policy's variables (the endpoint a pod's name there; the run named here)
        cmd = [sys.executable, "tests/slurm/slowed.py", *args]
        pod = {"PET_NNODES": "1:2", "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}",
               "PET_RDZV_ID": "elastic-memory", "PET_NPROC_PER_NODE": "1"}
    machines = []
    for rank in (0, 1):  # the first attempt held at step 14, the restarted one at its load (and in pods, step 15)
        own = ELASTIC_ENV if started == "torchrun" else {**pod, "HOSTNAME": f"dpo-worker-{rank}"}  # trl_ext sets it
        env = {**own, "HF_HOME": str(tmp_path / "hf"), "TRL_EXT_MEMORY_DIR": str(tmp_path / f"shm-{rank}"),
               **_held(tmp_path), "TRL_EXT_TEST_RUNS": "0,1"}
        env["TRL_EXT_TEST_HOLD"] = "step-14,load" + (",step-15" if started == "pods" else "")
        machines.append(Machine(f"machine-{rank}", cmd, env, tmp_path / f"machine-{rank}.log"))
        if rank == 0:
            wait_for_port(port, 300, machines[0])  # the first machine hosts the rendezvous and survives
    _wait_until_replicated(tmp_path, 12, machines)
    lost = machines[1].die()
    _release(tmp_path)
    machines[0].when(r"\[test\] holding load", 600, after=lost)  # resharded for one machine, before DeepSpeed loads it
    converted = next((tmp_path / "shm-0").glob("*/checkpoint-12"))
    assert list(converted.glob("*_universal")) and memory_tier.MemoryTier._damage(converted) is None  # still whole
    (tmp_path / "hold" / "release-load").touch()
    if started == "pods":  # the lost pod recreated on a new node joins the running job (below)
        _rejoin(machines, tmp_path, lost)
    code = machines[0].wait(600)
    log = machines[0].output
    assert code == 0, log[-6000:]
    orchestrator = "torchrun" if started == "torchrun" else "Kubeflow"
    if started == "pods":  # trl_ext's rendezvous settings, said; the first round waited for the second pod
        assert ("elastic, 1 to 2 machines of 1 processes, meeting in torchrun's rendezvous at 127.0.0.1:"
                f"{port} (join_timeout=600,last_call_timeout=2,keep_alive_interval=1)") in log, log[-6000:]
        worlds = [line for line in log.splitlines() if line.startswith("[trl_ext] Kubeflow: rank 0 of ")]
        assert worlds[0].startswith("[trl_ext] Kubeflow: rank 0 of 2 on 2 machine(s)"), worlds
    assert f"{orchestrator}: rank 0 of 1 on 1 machine(s)" in log, log[-6000:]  # alone, after the loss
    resumed = [line for line in log.splitlines() if "resuming from step" in line]
    assert "restart 1: resuming from step 12 in memory (" in resumed[0], resumed or log[-6000:]
    if started == "pods":  # grown again to 2 machines: the step the survivor took alone, given to the new machine
        assert len(resumed) == 2 and "resuming from step 14 in memory (" in resumed[1], resumed
        assert ("memory checkpoint-14 (taken on 1 machine, resumed on 2): machine 1 received machine 0's part from "
                "machine 0") in log, log[-6000:]
        # the grow's restart killed the held ranks, a failure; the attempt before had made progress, in memory
        assert "attempt 3: the attempt before it did not finish (1 failed attempt(s) in a row" in log, log[-6000:]
        assert worlds[-1].startswith("[trl_ext] Kubeflow: rank 0 of 2 on 2 machine(s)") and len(worlds) == 3, worlds
    else:
        assert len(resumed) == 1, resumed
    assert f"saved and verified: {out}" in log
    assert audit(str(out), base=None).ok
