"""One node of a Slurm job: ``recipes/slurm.sbatch`` runs ``python -m trl_ext.scheduling.node RECIPE [options]`` once
per node (``srun --ntasks-per-node=1``). It runs the recipe (or ``trl-ext <command>``), which launches its processes
with what Slurm decided (``machine_args``: the number of machines, this machine's rank, the first node's address and
a port derived from the job id, the total number of processes) in place of its accelerate config's own.

Slurm delivers its signals (the time-limit warning the batch script passes on, ``scancel``, ``scontrol requeue``,
preemption, the time limit itself) to every process of the job step. The ranks record them and agree at the next step
boundary to save a checkpoint and stop (``scheduling.preemption``). The processes in between must outlive the warning
(SIGUSR1, whose default is to end a process): this launcher starts its children ignoring it (the ranks install their
own handler when training starts) and, once warned, sends it again every few seconds to everything it started, so
that a warning that came before training started is acted on as soon as it has. It exits with its children's code.
"""

import json
import os
import signal
import subprocess
import sys

from trl_ext.errors import UsageError
from trl_ext.process import notice
from trl_ext.scheduling import job as slurm

NODE_ENV = "TRL_EXT_SLURM_NODE"  # set for what this launcher runs: Slurm's machine arguments, as JSON
CPU_PROCESSES_PER_NODE = 2  # the recipes' default without a GPU
RESEND_SECONDS = 5  # once warned, the warning is sent again this often until the processes end


def machine_args(num_processes: int | None = None) -> tuple[list[str], str] | None:
    """The ``accelerate launch`` arguments Slurm decides, for a launch run by this launcher, and the one line that
    says so; None outside one.

    Args:
        num_processes: the total the user asked for (``--num_processes``), else one per GPU on every node (2 per node
            on CPU).

    Returns:
        ``(arguments, line)``: ``--num_machines``, ``--machine_rank``, ``--main_process_ip``, ``--main_process_port``,
        ``--num_processes`` and DeepSpeed's per-node launcher (torchrun on each node, not pdsh).
    """
    node = os.environ.get(NODE_ENV)
    if not node:
        return None
    node = json.loads(node)
    per_node = node["gpus"] or CPU_PROCESSES_PER_NODE
    total = num_processes or per_node * node["nodes"]
    args = ["--num_machines", str(node["nodes"]), "--machine_rank", str(node["node_rank"]),
            "--main_process_ip", node["address"], "--main_process_port", str(node["port"]),
            "--num_processes", str(total), "--rdzv_backend", "static", "--same_network",
            "--deepspeed_multinode_launcher", "standard"]
    line = (f"Slurm job {node['job_id']} (restart {node['restart']}): {node['nodes']} machine(s), this one number "
            f"{node['node_rank']}, {total} processes, rendezvous {node['address']}:{node['port']}; these replace the "
            f"accelerate config's machines, ranks, address and port")
    return args, line


def _gpus() -> int:
    """This node's GPUs: Slurm's count when it allocated them, else the visible devices, else CUDA's (torch is
    imported only on a machine with an NVIDIA device)."""
    if os.environ.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(os.environ["SLURM_GPUS_ON_NODE"])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if not os.path.exists("/dev/nvidia0"):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _child_ignores_warning() -> None:  # in the child, before exec: the ranks install their own handler
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _send_to_all(pid: int, signum: int) -> None:
    """``signum`` to ``pid`` and every process below it (those that ignore it, ignore it)."""
    import psutil

    try:
        family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in family:
        try:
            process.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


def main(argv: list[str] | None = None) -> int:
    """Run ``RECIPE [options]`` (a recipe's path, or ``trl-ext``) on this node of the Slurm job.

    Args:
        argv: the recipe and its options (default: the command line).

    Returns:
        The recipe's exit code.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    job = slurm.current()
    if not argv:
        raise UsageError("usage: python -m trl_ext.scheduling.node RECIPE [recipe options] (one per node, under "
                         "srun; see recipes/slurm.sbatch)")
    if job is None:
        raise UsageError("python -m trl_ext.scheduling.node runs inside a Slurm job (SLURM_JOB_ID is not set): submit "
                         "it with sbatch recipes/slurm.sbatch RECIPE [options]")
    node = {"job_id": job.job_id, "restart": job.restart, "nodes": job.nodes, "node_rank": job.node_rank,
            "address": slurm.main_address(job), "port": job.port, "gpus": _gpus()}
    command = argv if argv[0] == "trl-ext" else [sys.executable, *argv]
    env = {**os.environ, NODE_ENV: json.dumps(node)}
    warned = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: warned.append(signum))  # for the ranks; this one waits
    child = subprocess.Popen(command, env=env, preexec_fn=_child_ignores_warning)
    while True:
        try:
            code = child.wait(timeout=RESEND_SECONDS)
            break
        except subprocess.TimeoutExpired:
            if warned:
                _send_to_all(child.pid, signal.SIGUSR1)
        except KeyboardInterrupt:  # a SIGINT: the child has it too
            continue
    if code and job.node_rank == 0:
        notice(f"Slurm job {job.job_id}: this node's processes ended with exit code {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
