"""Who started this process, asked the same five questions whatever the orchestrator: which machines, which one am I,
where do we meet, which run is this, was I restarted. Each orchestrator's variables are read in this package and
nowhere else (``tests/unit/test_layout.py`` checks it against ``VARIABLES``): one module per orchestrator
(``slurm``, ``torchrun``, ``kubernetes``, ``skypilot``, ``ray_job``), each answering with a whole ``Job`` (``job``).

Two kinds of launchers start training processes:

- one process per rank: torchrun (static or elastic; also inside ``accelerate launch``, a Kubeflow pod whose command
  is torchrun, and ``trl_ext.launching.node``'s launches). This process trains as that rank.
- one process per machine: Slurm (through ``recipes/slurm.sbatch``), SkyPilot, Kubernetes pods with torchrun's
  ``PET_*`` variables whose command is the recipe (Kubeflow Trainer, PyTorchJob, a JobSet or plain Job that sets
  them), LeaderWorkerSet. That process starts its machine's ranks (``launching.node``).
- one process for the whole cluster: a Ray job's driver (``ray job submit``, KubeRay's RayJob). It starts the ranks as
  a Ray Train worker group (``trl_ext.ray``), each started with the job in ``TRL_EXT_NODE``.

The run's identity is what the orchestrator keeps across its own restarts: a Slurm job id, a SkyPilot task id, a
TrainJob or JobSet name, a LeaderWorkerSet group, torchrun's ``--rdzv-id``, a Ray job's submission id;
``TRL_EXT_RUN_ID`` names it anywhere. Where the orchestrator names no rendezvous port, one is derived from that
identity (``meeting_port``).
Nothing here imports torch or starts anything (but ``scontrol`` for a Slurm job's first node): it is read before any
heavy import.
"""

from dataclasses import replace

from trl_ext.placement.orchestrators import kubernetes, ray_job, skypilot, slurm, torchrun
from trl_ext.placement.orchestrators.job import (
    CPU_PROCESSES_PER_NODE,
    NODE_ENV,
    PORT_BASE,
    PORT_ENV,
    PORT_SPAN,
    RUN_ID_ENV,
    TORCHRUN_PORT,
    Job,
    default_per_node,
    local_gpus,
    meeting_port,
    value,
)
from trl_ext.settings import environment

# Every orchestrator's variable (and name prefix) that a reader here looks at or a launch sets: read nowhere else.
VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "NODE_RANK",
             "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "JOB_COMPLETION_INDEX",
             "JOBSET_NAME", "RAY_JOB_CONFIG_JSON_ENV_VAR", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", RUN_ID_ENV, PORT_ENV,
             NODE_ENV)
PREFIXES = ("SLURM", "PET_", "LWS_", "SKYPILOT_", "TORCHELASTIC_")

__all__ = ["CPU_PROCESSES_PER_NODE", "NODE_ENV", "PORT_BASE", "PORT_ENV", "PORT_SPAN", "PREFIXES", "RUN_ID_ENV",
           "TORCHRUN_PORT", "VARIABLES", "Job", "current", "default_per_node", "kubernetes", "local_gpus",
           "machine_speaks", "meeting_port", "ray_job", "skypilot", "slurm", "torchrun"]


def current() -> Job | None:
    """This process's job, or None when no orchestrator started it (a plain ``python recipe.py``).

    Returns:
        The job: one process per rank under torchrun (its run and restarts those of the orchestrator around it, if
        any), else one process per machine under the first orchestrator whose variables are set.

    Raises:
        UsageError: variables that contradict each other (a node rank beyond the count, no address, a port that is
            not one), named in one line, on every process.
    """
    launched = value(NODE_ENV)
    # the view of the node launcher (or a Ray worker), passed down to what it started
    outer = replace(Job.from_env(launched), node_launched=True) if launched else None
    a_rank = torchrun.started_a_rank()
    if outer is None:
        readers = (ray_job.read, lambda: slurm.read(find_address=not a_rank), kubernetes.kubeflow,
                   kubernetes.leader_worker_set, skypilot.read)  # Ray first: a cluster that Slurm started
        for read in readers:
            outer = read()
            if outer is not None:
                break
    job = torchrun.read(outer) or outer
    if job is not None and environment.RUN_ID.source():
        job = replace(job, run=environment.RUN_ID.text())
    return job


def machine_speaks(job: Job | None) -> bool:
    """Whether this machine prints the run's one-line notices: the first machine, before its ranks exist (each machine's
    launcher process reads the same input and would say the same), and every rank (its notices are rank 0's).

    Args:
        job: this process's job (``current()``).
    """
    return job is None or job.per_rank or job.node_rank == 0
