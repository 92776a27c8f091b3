"""The Slurm job this process runs in, read from the variables Slurm sets: its id, how many times it was requeued,
its nodes and this node's place among them. Nothing here starts or asks anything of Slurm but ``main_address``,
which asks ``scontrol`` where the first node is."""

import os
import socket
import subprocess
from dataclasses import dataclass

PORT_BASE, PORT_SPAN = 20000, 10000  # the rendezvous port: the job id's, the same on every node, another per job


@dataclass(frozen=True)
class SlurmJob:
    """A Slurm job as one of its processes sees it.

    Args:
        job_id: ``SLURM_JOB_ID``, the same across requeues.
        restart: ``SLURM_RESTART_COUNT``: 0 for the first run, N after N requeues.
        nodes: ``SLURM_JOB_NUM_NODES``.
        node_rank: ``SLURM_NODEID``: this node's place in the job's node list (0 is the first).
        node_list: ``SLURM_JOB_NODELIST`` (compressed, ``n[1-2]``).
    """

    job_id: str
    restart: int
    nodes: int
    node_rank: int
    node_list: str

    @property
    def port(self) -> int:
        """The rendezvous port, derived from the job id: the same on every node, different for concurrent jobs."""
        return PORT_BASE + int(self.job_id) % PORT_SPAN if self.job_id.isdigit() else PORT_BASE


def current() -> SlurmJob | None:
    """The Slurm job of this process, or None outside one.

    Returns:
        The job, from Slurm's variables (``SLURM_JOB_ID`` and the ones beside it).
    """
    job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")
    if not job_id:
        return None
    env = os.environ.get
    return SlurmJob(job_id=job_id, restart=int(env("SLURM_RESTART_COUNT", "0") or 0),
                    nodes=int(env("SLURM_JOB_NUM_NODES", env("SLURM_NNODES", "1")) or 1),
                    node_rank=int(env("SLURM_NODEID", "0") or 0),
                    node_list=env("SLURM_JOB_NODELIST", env("SLURM_NODELIST", "")) or "")


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30, check=True).stdout


def main_address(job: SlurmJob) -> str:
    """The first node's address, where rank 0 listens: its ``NodeAddr`` in Slurm's configuration (node names need not
    resolve as hosts), else its name resolved, else the address of the node this step was launched from.

    Args:
        job: the job.

    Returns:
        An address every node can reach.
    """
    first = None
    try:
        first = _scontrol("show", "hostnames", job.node_list).split()[0]
        fields = dict(f.split("=", 1) for f in _scontrol("show", "node", first, "-o").split() if "=" in f)
        if fields.get("NodeAddr"):
            return fields["NodeAddr"]
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        pass
    if first:
        try:
            return socket.gethostbyname(first)
        except OSError:
            pass
    return os.environ.get("SLURM_LAUNCH_NODE_IPADDR") or "127.0.0.1"
