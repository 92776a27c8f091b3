"""Which process this one becomes, decided once, in one place, from its job (``placement.orchestrators``) and whether
it runs under accelerate's launch, before torch or TRL is imported:

- ``RAY_DRIVER``: a Ray job's driver: ``python -m trl_ext.ray``, which runs the ranks as a Ray Train worker group;
- ``NODE_LAUNCHER``: one machine's process of a job that an orchestrator placed on several machines (SkyPilot, pods
  with torchrun's ``PET_*`` variables, LeaderWorkerSet), not yet under the node launcher: ``python -m
  trl_ext.launching.node``, which meets the other machines and runs the same command as its child;
- ``MACHINE``: the node launcher's child: ``accelerate launch`` with the orchestrator's machines, this machine's rank,
  the first machine's address and port; for an elastic job, torchrun in a c10d rendezvous (``launching.elastic``),
  whose ranks decide as ranks;
- ``ACCELERATE``: a plain process under an accelerate config: ``accelerate launch`` on this machine;
- ``RANK``: train in this process: a rank that torchrun, ``accelerate launch`` or Ray Train started, or one process.

A launch hands its decision down in ``TRL_EXT_LAUNCH`` (``handed_down``), and what it starts follows it instead of
deciding again: the node launcher's child launches its machine's ranks, a launch's ranks train. A process that decided
to train here records that there too, for itself only: a recipe asks at its first line and again when it parses its
arguments, and the second ask is answered by the first.
"""

import enum
import os
from dataclasses import dataclass

from trl_ext.placement.orchestrators import Job

LAUNCH_ENV = "TRL_EXT_LAUNCH"  # "<decision>:<pid of the process that made it>", for what that process starts


class Become(enum.Enum):
    RAY_DRIVER = "ray-driver"
    NODE_LAUNCHER = "node-launcher"
    MACHINE = "machine"
    ACCELERATE = "accelerate"
    RANK = "rank"


# What a process that each launch started becomes.
STARTED_BY = {Become.RAY_DRIVER: Become.RANK, Become.NODE_LAUNCHER: Become.MACHINE, Become.MACHINE: Become.RANK,
              Become.ACCELERATE: Become.RANK}


@dataclass(frozen=True)
class Decision:
    """What this process becomes, and why.

    Args:
        become: the process it becomes (``Become``).
        started_by: the launch of trl_ext that started this process and decided for it (``NODE_LAUNCHER``,
            ``MACHINE``, ``ACCELERATE``), or None where this process decided from its job.
        decided_before: this process decided already (to train here): nothing is said or applied again.
    """

    become: Become
    started_by: Become | None = None
    decided_before: bool = False


def _carried() -> tuple[Become | None, int | None]:
    text = os.environ.get(LAUNCH_ENV, "")
    name, _, pid = text.partition(":")
    try:
        return Become(name), int(pid) if pid.isdigit() else None
    except ValueError:
        return None, None


def _from_job(job: Job | None, accelerate: bool) -> Become:
    if job is not None and job.orchestrator == "Ray" and not job.per_rank:  # Ray first: a cluster Slurm started
        return Become.RAY_DRIVER
    if job is not None and job.per_rank:
        return Become.RANK
    if job is not None and job.node_launched:
        return Become.MACHINE
    if job is not None and job.nodes > 1:
        return Become.NODE_LAUNCHER
    return Become.ACCELERATE if accelerate else Become.RANK


def decide(job: Job | None, accelerate: bool) -> Decision:
    """What this process becomes: what the launch that started it decided for it, else what its job says.

    Args:
        job: this process's job (``orchestrators.current()``), or None.
        accelerate: it runs under accelerate's launch unless it is a rank already (an accelerate config on a recipe's
            command line; always for ``trl-ext <command>``, TRL's command line).

    Returns:
        The decision.
    """
    carried, pid = _carried()
    if carried is Become.RANK and pid == os.getpid():
        return Decision(Become.RANK, decided_before=True)
    if carried in STARTED_BY:
        follows = STARTED_BY[carried]
        if follows is not Become.MACHINE or (job is not None and job.node_launched and not job.per_rank):
            return Decision(follows, started_by=carried)
    return Decision(_from_job(job, accelerate))


def handed_down(become: Become) -> dict[str, str]:
    """The variable that hands the decision ``become`` down to the processes it starts (or, for ``RANK``, to this
    process's next ask)."""
    return {LAUNCH_ENV: f"{become.value}:{os.getpid()}"}


def decided_here() -> None:
    """Record that this process trains here, so that its next ask (``decide``) is answered by this one."""
    os.environ.update(handed_down(Become.RANK))
