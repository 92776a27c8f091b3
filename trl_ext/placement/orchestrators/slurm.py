"""Slurm's variables: the job's id, how many times it was requeued, its nodes, this node's place and name, the GPUs
it allocated here. Nothing here starts or asks anything of Slurm but ``main_address``, which asks ``scontrol`` where the
first node is (only for a job of several nodes, and only in a machine's own process)."""

import os
import socket
import subprocess

from trl_ext.placement.orchestrators.job import Job, meeting_port, value


def read(find_address: bool = True) -> Job | None:
    """The Slurm job of this process, whole: its nodes, this node's place, the first node's address, the port, the
    GPUs Slurm allocated here; or None outside one.

    Args:
        find_address: ask Slurm for the first node's address (a job of several nodes); a rank that torchrun started
            has its own (``MASTER_ADDR``) and asks nothing.

    Returns:
        The job (one process per machine).
    """
    found = job_id()
    if not found:
        return None
    nodes = int(value("SLURM_JOB_NUM_NODES") or value("SLURM_NNODES") or 1)
    hosts = value("SLURM_JOB_NODELIST") or value("SLURM_NODELIST") or ""
    gpus = value("SLURM_GPUS_ON_NODE")
    run = f"slurm-{found}"
    return Job("Slurm", per_rank=False, nodes=nodes, node_rank=int(value("SLURM_NODEID") or 0),
               address=main_address(hosts) if find_address and nodes > 1 else None, port=meeting_port(run),
               per_node=int(gpus) if gpus is not None and gpus.isdigit() else None, run=run,
               restart=int(value("SLURM_RESTART_COUNT") or 0), source="SLURM_JOB_ID", job_id=found, hosts=hosts,
               host=value("SLURMD_NODENAME"))


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30, check=True).stdout


def main_address(hosts: str) -> str:
    """The first node's address, where rank 0 listens: its ``NodeAddr`` in Slurm's configuration (node names need not
    resolve as hosts), else its name resolved, else the address of the node this step was launched from.

    Args:
        hosts: the job's node list (``n[1-2]``).

    Returns:
        An address every node can reach.
    """
    first = None
    try:
        first = _scontrol("show", "hostnames", hosts).split()[0]
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


def job_id() -> str | None:
    """The Slurm job this process runs in, whoever started the process (a Ray cluster inside a Slurm job too): the
    time-limit warning's timing is Slurm's."""
    return value("SLURM_JOB_ID") or value("SLURM_JOBID")
