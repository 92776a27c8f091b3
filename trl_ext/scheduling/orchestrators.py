"""Who started this process, asked the same five questions whatever the orchestrator: which machines, which one am I,
where do we meet, which run is this, was I restarted. Each orchestrator's variables are read here and nowhere else.

Two kinds of launchers start training processes:

- one process per rank: torchrun (static or elastic; also inside ``accelerate launch``, a Kubeflow pod whose command
  is torchrun, and ``trl_ext.scheduling.node``'s launches). This process trains as that rank.
- one process per machine: Slurm (through ``recipes/slurm.sbatch``), SkyPilot, Kubernetes pods with torchrun's
  ``PET_*`` variables whose command is the recipe (Kubeflow Trainer, PyTorchJob, a JobSet or plain Job that sets
  them), LeaderWorkerSet. That process starts its machine's ranks (``scheduling.node``).
- one process for the whole cluster: a Ray job's driver (``ray job submit``, KubeRay's RayJob). It starts the ranks as
  a Ray Train worker group (``trl_ext.ray``), each started with the job in ``TRL_EXT_NODE``.

The run's identity is what the orchestrator keeps across its own restarts: a Slurm job id, a SkyPilot task id, a
TrainJob or JobSet name, a LeaderWorkerSet group, torchrun's ``--rdzv-id``, a Ray job's submission id;
``TRL_EXT_RUN_ID`` names it anywhere.
Nothing here imports torch or starts anything: it is read before any heavy import.
"""

import ipaddress
import json
import os
import re
import socket
import zlib
from dataclasses import asdict, dataclass, replace

from trl_ext.errors import UsageError

RUN_ID_ENV = "TRL_EXT_RUN_ID"  # the run's identity, when the orchestrator's own is not the one to use
PORT_ENV = "TRL_EXT_MASTER_PORT"  # the rendezvous port where the orchestrator names none (SkyPilot, LeaderWorkerSet)
NODE_ENV = "TRL_EXT_NODE"  # set by the node launcher (``scheduling.node``) for what it starts: its ``Job``, as JSON
TORCHRUN_PORT = 29500  # torchrun's and accelerate's default
PORT_BASE, PORT_SPAN = 20000, 10000  # a port derived from a run id: the same on every node, another per run
# Kubeflow Trainer's first node: <trainjob>-node-0-0.<trainjob> (its torch plugin's PET_MASTER_ADDR)
_TRAINJOB = re.compile(r"^(?P<name>[a-z0-9-]+)-node-0-0\.(?P=name)(\.|$)")


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
            without one).
        run: which run is this: an identity the same across the orchestrator's restarts of the job, or None.
        restart: was I restarted: the restarts of this job so far where the orchestrator counts them (0 otherwise).
        rank: this process's global rank (``per_rank`` only).
        world_size: the number of ranks (``per_rank`` only).
        source: the variables this was read from, for messages.
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
        else:
            world = f"machine {self.node_rank} of {self.nodes}"
        where = f", rendezvous {self.address}:{self.port}" if self.address and self.nodes > 1 else ""
        run = f", run {self.run}" if self.run else ""
        again = f", restart {self.restart}" if self.restart else ""
        return f"{self.orchestrator}: {world}{where}{run}{again}"

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, text: str) -> "Job":
        return cls(**json.loads(text))


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value.strip() if value is not None and value.strip() else None


def _integer(name: str, value: str | None, minimum: int = 0) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = None
    if number is None or number < minimum:
        raise UsageError(f"{name}={value!r} is not a whole number >= {minimum}; check the job's environment.",
                         every_rank=True)
    return number


def _node_rank(name: str, value: str | None, nodes: int, nodes_name: str) -> int:
    rank = _integer(name, value)
    if rank >= nodes:
        raise UsageError(f"{name}={rank} is beyond {nodes_name}={nodes} (machines are numbered 0 to {nodes - 1}); "
                         "check the job's environment.", every_rank=True)
    return rank


def _port(name: str, value: str | None) -> int:
    port = _integer(name, value, minimum=1)
    if port > 65535:
        raise UsageError(f"{name}={port} is not a TCP port (1-65535).", every_rank=True)
    return port


def _per_node(name: str, value: str | None) -> int | None:
    """torchrun's ``--nproc-per-node``: a number, or one of its words (``auto``, ``gpu``: one per GPU, which is
    trl_ext's default too; ``cpu``: one per core)."""
    if value is None or value in ("auto", "gpu"):
        return None
    if value == "cpu":
        return os.cpu_count() or 1
    return _integer(name, value, minimum=1)


def derived_port(run: str | None) -> int:
    """A rendezvous port for an orchestrator that names none: ``TRL_EXT_MASTER_PORT``, else one derived from the run's
    identity (the same on every machine, another for a concurrent run), else torchrun's default."""
    if _env(PORT_ENV):
        return _port(PORT_ENV, _env(PORT_ENV))
    return PORT_BASE + zlib.crc32(run.encode()) % PORT_SPAN if run else TORCHRUN_PORT


def _is_name(address: str | None) -> bool:
    """Whether ``address`` is a host name (stable across a Kubernetes job's pods) rather than an IP address."""
    if not address or address == "localhost":
        return False
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return True
    return False


def _kubernetes_run(address: str | None) -> str | None:
    """A Kubernetes job's identity: the JobSet's name where the manifest passes it on (``JOBSET_NAME``), the TrainJob's
    name in Kubeflow Trainer's first-node address, else that address itself when it is a name (a PyTorchJob's
    ``<job>-master-0``): each stays the same when the job's pods are recreated."""
    if _env("JOBSET_NAME"):
        return f"jobset-{_env('JOBSET_NAME')}"
    if address and (match := _TRAINJOB.match(address)):
        return f"trainjob-{match.group('name')}"
    return f"k8s-{address.split('.')[0]}" if _is_name(address) else None


def _slurm() -> Job | None:
    from trl_ext.scheduling import slurm

    job = slurm.current()
    if job is None:
        return None
    return Job("Slurm", per_rank=False, run=f"slurm-{job.job_id}", restart=job.restart, port=job.port,
               source="SLURM_JOB_ID")


def _kubeflow() -> Job | None:
    """torchrun's own variables in a pod whose command is not torchrun (Kubeflow Trainer and PyTorchJob set them; a
    JobSet or plain Job manifest can too). The node rank falls back to an indexed Job's ``JOB_COMPLETION_INDEX``."""
    if not (_env("PET_NNODES") and (_env("PET_NODE_RANK") or _env("JOB_COMPLETION_INDEX"))):
        return None
    nodes_text = _env("PET_NNODES")
    if ":" in nodes_text:  # an elastic range: this launch starts the most it allows, as one static round
        nodes_text = nodes_text.split(":")[1]
    nodes = _integer("PET_NNODES", nodes_text, minimum=1)
    rank_name = "PET_NODE_RANK" if _env("PET_NODE_RANK") else "JOB_COMPLETION_INDEX"
    node_rank = _node_rank(rank_name, _env(rank_name), nodes, "PET_NNODES")
    if rank_name == "JOB_COMPLETION_INDEX" and nodes > 1:
        _refuse_jobset_replicas(node_rank, _env("PET_MASTER_ADDR") or _env("MASTER_ADDR"))
    address = _env("PET_MASTER_ADDR") or _env("MASTER_ADDR")
    if nodes > 1 and not address:
        raise UsageError("PET_MASTER_ADDR is not set: with PET_NNODES > 1 every pod needs the first pod's address.",
                         every_rank=True)
    port_value = _env("PET_MASTER_PORT") or _env("MASTER_PORT")
    port = _port("PET_MASTER_PORT", port_value) if port_value else TORCHRUN_PORT
    return Job("Kubeflow", per_rank=False, nodes=nodes, node_rank=node_rank, address=address, port=port,
               per_node=_per_node("PET_NPROC_PER_NODE", _env("PET_NPROC_PER_NODE")), run=_kubernetes_run(address),
               source="PET_NNODES, " + rank_name)


def _refuse_jobset_replicas(completion_index: int, address: str | None) -> None:
    """A JobSet of ``replicas: N`` Jobs of one pod each gives every pod ``JOB_COMPLETION_INDEX=0`` (its index in its
    own Job): every pod would act as machine 0 and the first would wait for the others in vain. JobSet names each pod's
    host ``<jobset>-<replicatedJob>-<job index>-<pod index>``, and the first pod's address is one of them: a pod of
    another Job than the first's is refused in one line (the first pod then fails with the JobSet)."""
    host = _env("HOSTNAME") or socket.gethostname()
    jobset = _env("JOBSET_NAME")
    prefixes = [rf"{re.escape(jobset)}-.+"] if jobset else []
    first = re.match(r"^(?P<prefix>.+)-(?P<job>\d+)-\d+$", (address or "").split(".")[0])
    if first:  # the same replicated Job as the first pod's, which is in Job 0 (or whichever its address names)
        prefixes.append(re.escape(first.group("prefix")))
    for prefix in prefixes:
        match = re.match(rf"^{prefix}-(?P<job>\d+)-\d+$", host)
        if match and match.group("job") != (first.group("job") if first else "0"):
            raise UsageError(
                f"JOB_COMPLETION_INDEX={completion_index} is this pod's index in its own Job, but the pod ({host}) is "
                f"in Job {match.group('job')} of {f'JobSet {jobset}' if jobset else 'its JobSet'}: with `replicas: N` "
                "every Job's pods count from 0. Set PET_NODE_RANK from the Job's index in the pod's env (valueFrom: "
                "{fieldRef: {fieldPath: \"metadata.labels['jobset.sigs.k8s.io/job-index']\"}}), as "
                "examples/kubernetes/jobset.yaml does.", every_rank=True)


def _leader_worker_set() -> Job | None:
    if not (_env("LWS_LEADER_ADDRESS") and _env("LWS_GROUP_SIZE")):
        return None
    nodes = _integer("LWS_GROUP_SIZE", _env("LWS_GROUP_SIZE"), minimum=1)  # the leader and its workers
    node_rank = _node_rank("LWS_WORKER_INDEX", _env("LWS_WORKER_INDEX") or "0", nodes, "LWS_GROUP_SIZE")
    address = _env("LWS_LEADER_ADDRESS")
    run = f"lws-{address.split('.')[0]}"  # <lws>-<group>: the group's leader, the same when the group is recreated
    return Job("LeaderWorkerSet", per_rank=False, nodes=nodes, node_rank=node_rank, address=address,
               port=derived_port(None), run=run, source="LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX")


def _skypilot() -> Job | None:
    if _env("SKYPILOT_NODE_RANK") is None or _env("SKYPILOT_NODE_IPS") is None:
        return None
    ips = [line.strip() for line in _env("SKYPILOT_NODE_IPS").splitlines() if line.strip()]
    nodes = _integer("SKYPILOT_NUM_NODES", _env("SKYPILOT_NUM_NODES") or str(len(ips)), minimum=1)
    if len(ips) != nodes:
        raise UsageError(f"SKYPILOT_NODE_IPS lists {len(ips)} address(es) but SKYPILOT_NUM_NODES={nodes}; check the "
                         "task's environment.", every_rank=True)
    node_rank = _node_rank("SKYPILOT_NODE_RANK", _env("SKYPILOT_NODE_RANK"), nodes, "SKYPILOT_NUM_NODES")
    gpus = _integer("SKYPILOT_NUM_GPUS_PER_NODE", _env("SKYPILOT_NUM_GPUS_PER_NODE") or "0")
    run = f"skypilot-{_env('SKYPILOT_TASK_ID')}" if _env("SKYPILOT_TASK_ID") else None  # kept across recoveries
    return Job("SkyPilot", per_rank=False, nodes=nodes, node_rank=node_rank, address=ips[0], port=derived_port(run),
               per_node=gpus or None, run=run, source="SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS, SKYPILOT_NUM_NODES")


def _ray() -> Job | None:
    """The driver of a Ray job (``ray job submit -- python recipes/dpo.py ...``; KubeRay's RayJob submits the same way):
    Ray's job supervisor gives it the job's config, whose submission id names the run. One process for the cluster: it
    starts the ranks as a Ray Train worker group (``trl_ext.ray``)."""
    text = _env("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if text is None:
        return None
    try:
        submission = (json.loads(text).get("metadata") or {}).get("job_submission_id")
    except (ValueError, AttributeError):
        submission = None
    return Job("Ray", per_rank=False, run=f"ray-{submission}" if submission else None,
               source="RAY_JOB_CONFIG_JSON_ENV_VAR")


def _torchrun(outer: Job | None) -> Job | None:
    """A rank started by torchrun (also inside ``accelerate launch``): ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``.
    A PyTorchJob pod's own ``RANK`` and ``WORLD_SIZE`` (its index and the pod count, without ``LOCAL_RANK``) are not
    a rank's."""
    if not (_env("RANK") and _env("WORLD_SIZE") and _env("LOCAL_RANK")):
        return None
    world = _integer("WORLD_SIZE", _env("WORLD_SIZE"), minimum=1)
    rank = _integer("RANK", _env("RANK"))
    if rank >= world:
        raise UsageError(f"RANK={rank} is beyond WORLD_SIZE={world}; check the launcher's environment.",
                         every_rank=True)
    nodes = int(_env("GROUP_WORLD_SIZE") or 1)
    run_id = _env("TORCHELASTIC_RUN_ID")
    run = outer.run if outer is not None and outer.run else (
        f"torchrun-{run_id}" if run_id and run_id != "none" else None)
    restart = int(_env("TORCHELASTIC_RESTART_COUNT") or 0) + (outer.restart if outer is not None else 0)
    return Job(outer.orchestrator if outer is not None else "torchrun", per_rank=True, nodes=nodes,
               node_rank=int(_env("GROUP_RANK") or 0), address=_env("MASTER_ADDR"),
               port=int(_env("MASTER_PORT")) if _env("MASTER_PORT") else None,
               per_node=int(_env("LOCAL_WORLD_SIZE") or world), run=run, restart=restart, rank=rank, world_size=world,
               source="torchrun" if outer is None else f"{outer.source}; torchrun")


def current() -> Job | None:
    """This process's job, or None when no orchestrator started it (a plain ``python recipe.py``).

    Returns:
        The job: one process per rank under torchrun (its run and restarts those of the orchestrator around it, if
        any), else one process per machine under the first orchestrator whose variables are set.

    Raises:
        UsageError: variables that contradict each other (a node rank beyond the count, no address, a port that is
            not one), named in one line, on every process.
    """
    launched = _env(NODE_ENV)
    outer = Job.from_env(launched) if launched else None  # the node launcher's view, passed down to its ranks
    if outer is None:
        for read in (_ray, _slurm, _kubeflow, _leader_worker_set, _skypilot):  # Ray first: a cluster Slurm started
            outer = read()
            if outer is not None:
                break
    job = _torchrun(outer) or outer
    if job is not None and _env(RUN_ID_ENV):
        job = replace(job, run=_env(RUN_ID_ENV))
    return job


def machine_speaks() -> bool:
    """Whether this machine prints the run's one-line notices: the first machine, before its ranks exist (each machine's
    launcher process reads the same input and would say the same)."""
    try:
        job = current()
    except SystemExit:  # contradictory variables: the error says so on every machine
        return True
    return job is None or job.per_rank or job.node_rank == 0
