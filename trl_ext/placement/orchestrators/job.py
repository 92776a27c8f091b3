"""The ``Job``, what every orchestrator's reader answers, and the reading of one variable: a value, a whole number, a
node rank, a port, torchrun's processes per node, and the one meeting port derived from a run's identity."""

import json
import os
import re
import zlib
from dataclasses import asdict, dataclass

from trl_ext.errors import UsageError
from trl_ext.settings import environment

RUN_ID_ENV = environment.RUN_ID.name  # the run's identity, when the orchestrator's own is not the one to use
PORT_ENV = environment.MASTER_PORT.name  # the meeting port where the orchestrator names none (Slurm, SkyPilot, LWS)
NODE_ENV = "TRL_EXT_NODE"  # set by the node launcher (``launching.node``) for what it starts: its ``Job``, as JSON
TORCHRUN_PORT = 29500  # torchrun's and accelerate's default
C10D_PORT = 29400  # torchrun's default port of a c10d rendezvous endpoint
PORT_BASE, PORT_SPAN = 20000, 10000  # a port derived from a run id: the same on every node, another per run
CPU_PROCESSES_PER_NODE = 2  # the recipes' default without a GPU


@dataclass(frozen=True)
class Job:
    """This process's job, as the orchestrator that started it describes it.

    Args:
        orchestrator: who decided the machines: "torchrun", "Slurm", "SkyPilot", "Kubeflow" (torchrun's ``PET_*``
            variables in a pod), "LeaderWorkerSet", "Ray".
        per_rank: whether this process was started as one rank (by torchrun or ``accelerate launch``); else it is its
            machine's one process, which starts the machine's ranks.
        nodes: which machines: how many take part (torchrun: in this round of an elastic job).
        node_rank: which one am I: this machine's place, 0 for the one whose address is the rendezvous.
        address: where do we meet: the first machine's address (None with one machine).
        port: the rendezvous port on it.
        per_node: processes per machine as the orchestrator set them (None: trl_ext's default, one per GPU or 2
            without one; ``default_per_node``); under Slurm the GPUs it allocated to this machine, where it did (0:
            none, and so 2 CPU processes).
        run: which run is this: an identity the same across the orchestrator's restarts of the job, or None.
        restart: was I restarted: the restarts of this job so far where the orchestrator counts them (0 otherwise).
        rank: this process's global rank (``per_rank`` only).
        world_size: the number of ranks (``per_rank`` only).
        source: the variables this was read from, for messages.
        job_id: the orchestrator's own id of the job, for its commands (Slurm's job id: ``squeue``, ``scontrol``);
            kept when ``TRL_EXT_RUN_ID`` names the run.
        hosts: the job's machines as the orchestrator lists them (Slurm's compressed node list), for asking it
            about them.
        host: this machine's name as the orchestrator calls it (Slurm's node name), else None.
        node_launched: this process was started under trl_ext's node launcher (``launching.node``) or a Ray
            worker, which passed this job down in ``TRL_EXT_NODE``.
        min_nodes: an elastic job's fewest machines (``nodes`` is then its most), whose machines meet in torchrun's
            c10d rendezvous at ``address``:``port``, numbered by it; None for a job of ``nodes`` machines.
        max_restarts: the restarts of its ranks the orchestrator allows an elastic job (torchrun's
            ``--max-restarts``), or None where it sets none.
        rendezvous_conf: the orchestrator's own settings for that rendezvous (torchrun's ``--rdzv-conf``), or "".
    """

    orchestrator: str
    per_rank: bool
    nodes: int = 1
    node_rank: int = 0
    address: str | None = None
    port: int | None = None
    per_node: int | None = None
    run: str | None = None
    restart: int = 0
    rank: int = 0
    world_size: int = 1
    source: str = ""
    job_id: str | None = None
    hosts: str = ""
    host: str | None = None
    node_launched: bool = False
    min_nodes: int | None = None
    max_restarts: int | None = None
    rendezvous_conf: str = ""

    @property
    def elastic(self) -> bool:
        """Whether its machines may come and go (``min_nodes``): torchrun's c10d rendezvous numbers them."""
        return self.min_nodes is not None

    @property
    def label(self) -> str:
        """The run as its log lines name it: "Slurm job 4242", "SkyPilot run skypilot-sky-...", "torchrun"."""
        if self.orchestrator == "Slurm" and self.run and self.run.startswith("slurm-"):
            return f"Slurm job {self.run.removeprefix('slurm-')}"
        return f"{self.orchestrator} run {self.run}" if self.run else self.orchestrator

    def describe(self) -> str:
        """The one line that says which launcher and which world this process found."""
        if self.per_rank:
            world = f"rank {self.rank} of {self.world_size} on {self.nodes} machine(s)"
        elif self.elastic:
            world = f"{self.min_nodes} to {self.nodes} machines (elastic)"
        else:
            world = f"machine {self.node_rank} of {self.nodes}"
        where = f", rendezvous {self.address}:{self.port}" if self.address and self.nodes > 1 else ""
        run = f", run {self.run}" if self.run else ""
        again = f", restart {self.restart}" if self.restart else ""
        return f"{self.orchestrator}: {world}{where}{run}{again}"

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def handed_down(self) -> dict[str, str]:
        """The variables that hand this job down to the processes a launcher of trl_ext starts (the node launcher, a
        Ray worker): what ``current()`` reads there."""
        return {NODE_ENV: self.to_env()}

    @classmethod
    def from_env(cls, text: str) -> "Job":
        return cls(**json.loads(text))


def value(name: str) -> str | None:
    """The variable's value, stripped; None when it is unset or blank."""
    found = os.environ.get(name)
    return found.strip() if found is not None and found.strip() else None


def integer(name: str, text: str | None, minimum: int = 0) -> int:
    try:
        number = int(text)
    except (TypeError, ValueError):
        number = None
    if number is None or number < minimum:
        raise UsageError(f"{name}={text!r} is not a whole number >= {minimum}; check the job's environment.",
                         every_rank=True)
    return number


def node_rank(name: str, text: str | None, nodes: int, nodes_name: str) -> int:
    rank = integer(name, text)
    if rank >= nodes:
        raise UsageError(f"{name}={rank} is beyond {nodes_name}={nodes} (machines are numbered 0 to {nodes - 1}); "
                         "check the job's environment.", every_rank=True)
    return rank


def port(name: str, text: str | None) -> int:
    number = integer(name, text, minimum=1)
    if number > 65535:
        raise UsageError(f"{name}={number} is not a TCP port (1-65535).", every_rank=True)
    return number


def per_node(name: str, text: str | None) -> int | None:
    """torchrun's ``--nproc-per-node``: a number, or one of its words (``auto``, ``gpu``: one per GPU, which is
    trl_ext's default too; ``cpu``: one per core)."""
    if text is None or text in ("auto", "gpu"):
        return None
    if text == "cpu":
        return os.cpu_count() or 1
    return integer(name, text, minimum=1)


def meeting_port(run: str | None) -> int:
    """The rendezvous port for an orchestrator that names none (Slurm, SkyPilot, LeaderWorkerSet):
    ``TRL_EXT_MASTER_PORT``, else one derived from the run's identity (the same on every machine, another for a
    concurrent run), else torchrun's default. The one derivation of a meeting port.

    Args:
        run: the run's identity as the orchestrator keeps it (before ``TRL_EXT_RUN_ID`` renames it), or None.

    Returns:
        The port.
    """
    if environment.MASTER_PORT.source():
        return environment.MASTER_PORT.whole(minimum=1, maximum=65535)
    return PORT_BASE + zlib.crc32(run.encode()) % PORT_SPAN if run else TORCHRUN_PORT


def _listed(devices: str) -> int:
    """How many devices a ``*_VISIBLE_DEVICES`` list names (indices or UUIDs; "-1" hides every GPU)."""
    return len([d for d in devices.split(",") if d.strip() and d.strip() != "-1"])


def visible_gpus(device_dir: str = "/dev") -> int:
    """This machine's GPUs as this process sees them, without importing torch (its import costs the launcher seconds).

    In order: ``CUDA_VISIBLE_DEVICES`` where set; else ``NVIDIA_VISIBLE_DEVICES`` as NVIDIA's device plugin and
    container toolkit set it (a list of indices or UUIDs; ``none`` or ``void``: none); else (unset or ``all``) the
    NVIDIA device files present. A container keeps the host's device numbers: a pod given GPUs 4-7 has
    ``/dev/nvidia4`` to ``/dev/nvidia7`` and no ``/dev/nvidia0``.

    Args:
        device_dir: where the device files are (a test points it elsewhere).

    Returns:
        The number of GPUs (0 on a machine without one).
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return _listed(visible)
    nvidia = os.environ.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if nvidia in ("none", "void"):
        return 0
    if nvidia and nvidia != "all":
        return _listed(nvidia)
    try:
        return len([name for name in os.listdir(device_dir) if re.fullmatch(r"nvidia\d+", name)])
    except OSError:
        return 0


def local_gpus(job: Job | None = None) -> int:
    """This machine's GPUs: what Slurm allocated to it where it did (the job's ``per_node``), else the visible
    devices.

    Args:
        job: this process's job, or None.

    Returns:
        The number of GPUs (0 on a machine without one).
    """
    if job is not None and job.orchestrator == "Slurm" and job.per_node is not None:
        return job.per_node
    return visible_gpus()


def default_per_node(job: Job | None = None) -> int:
    """trl_ext's processes per machine where the orchestrator sets none: one per GPU, 2 CPU processes (gloo) on a
    machine without one."""
    return local_gpus(job) or CPU_PROCESSES_PER_NODE
