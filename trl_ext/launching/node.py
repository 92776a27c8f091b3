"""One machine of a job that an orchestrator started once per machine: ``recipes/slurm.sbatch`` runs
``python -m trl_ext.launching.node RECIPE [options]`` once per node (``srun --ntasks-per-node=1``), and a recipe (or
``trl-ext <command>``) that SkyPilot, a Kubernetes pod with torchrun's ``PET_*`` variables or a LeaderWorkerSet started
re-launches itself under it (``launching.launch``). It first meets the other machines within a stated time
(``rendezvous``; Slurm starts a job's nodes together), then runs the recipe, which launches this machine's ranks with
what the orchestrator decided (``launching.launch.machine_args``: the number of machines, this machine's rank, the
first machine's address and port, the processes) in place of its accelerate config's own. An elastic job's machines
(``PET_NNODES=MIN:MAX``) meet in torchrun's c10d rendezvous instead, which numbers them and restarts the ranks of
those left when one is lost (``launching.elastic``).

Schedulers deliver their signals (``scancel``, ``scontrol requeue``, preemption, the time limit, a pod's deletion) to
the job's processes; under Slurm the batch script passes the time-limit warning on as SIGURG, which this launcher turns
into SIGUSR1. The ranks record them and agree at the next step boundary to save a checkpoint and stop
(``trainers.preemption``). The processes in between stay out of it: this launcher starts its children with SIGUSR1
and SIGTERM ignored and tells torchrun to leave SIGTERM alone (it would otherwise stop the ranks itself and kill them
30 s later, whatever their checkpoint needs); the ranks install their own handlers when training starts. Once
signalled, the launcher sends the signal again every few seconds to everything it started, so that a signal that came
before training started is acted on as soon as it has.

When its processes end, the launcher reads what its ranks left (``placement.outcome``) and says in one line how this
machine ended, with an exit code a scheduler can act on (``launching.restart``; Kubernetes failure policies match
them): 0, 128 + the signal of a planned stop (138 for the warning, 143 for SIGTERM; the ranks themselves end quietly,
with 0, so that torchrun prints no traceback for it), ``restart.LOST`` (200) when its ranks lost a peer or their
machine, ``restart.ERROR`` (201) for an error of their own, ``failure_limit.GAVE_UP`` (202) when the run failed too
often in a row without a new checkpoint.
"""

import os
import shutil
import signal
import subprocess
import sys

from trl_ext.errors import GaveUp, SetupError, UsageError
from trl_ext.launching import rendezvous, restart
from trl_ext.placement import failure_limit, orchestrators, outcome, ownership
from trl_ext.placement.orchestrators import torchrun
from trl_ext.placement.ownership import RUN_ENV

RESEND_SECONDS = 5  # once signalled, the signal is sent again this often until the processes end
RECORDED = (signal.SIGUSR1, signal.SIGTERM)  # what the ranks act on; the processes in between ignore them
WARNING = signal.SIGURG  # the time-limit warning as the batch script passes it on: ignored by default, by the ranks too


def _child_ignores_signals() -> None:  # in the child, before exec: the ranks install their own handlers
    for signum in RECORDED:
        signal.signal(signum, signal.SIG_IGN)


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
        This node's exit code: 0, 138 or 143 for a planned stop, ``restart.LOST`` or ``restart.ERROR`` for a failure
        (else the recipe's own code).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        raise UsageError("usage: python -m trl_ext.launching.node RECIPE [recipe options] (one per machine: under "
                         "srun, see recipes/slurm.sbatch; or as a recipe re-launches itself under SkyPilot or a "
                         "Kubernetes pod)")
    job = machine()
    # Slurm starts a job's nodes together; pods and VMs come apart; an elastic job's meet in torchrun's rendezvous
    if job.nodes > 1 and job.orchestrator != "Slurm" and not job.elastic:
        try:
            rendezvous.gather(job, say=lambda line: print(f"[trl_ext] {job.label}: {line}", file=sys.stderr,
                                                          flush=True))
        except SetupError as exc:
            print(f"[trl_ext] {job.label}, node {job.node_rank}: error: {exc}", file=sys.stderr, flush=True)
            return restart.LOST
    run = ownership.run_dir(job)
    os.makedirs(run, exist_ok=True)
    command = [sys.executable, *(["-m", "trl_ext", *argv[1:]] if argv[0] == "trl-ext" else argv)]
    env = {torchrun.AGENT_LOG_LEVEL[0]: torchrun.AGENT_LOG_LEVEL[1], **os.environ,
           **job.handed_down(), RUN_ENV: run,
           torchrun.SIGNALS_OPTION[0]: torchrun.SIGNALS_OPTION[1]}
    received = set()
    for signum in RECORDED:  # for the ranks; this one waits
        signal.signal(signum, lambda signum, frame: received.add(signum))
    signal.signal(WARNING, lambda signum, frame: received.add(signal.SIGUSR1))
    child = subprocess.Popen(command, env=env, preexec_fn=_child_ignores_signals)
    while True:
        try:
            code = child.wait(timeout=RESEND_SECONDS)
            break
        except subprocess.TimeoutExpired:
            for signum in sorted(received):
                _send_to_all(child.pid, signum)
        except KeyboardInterrupt:  # a SIGINT: the child has it too
            continue
    for signum in (*RECORDED, WARNING):  # exiting now: Python's exit would give them back their default (to end it)
        signal.signal(signum, signal.SIG_IGN)
    code, line = ending(run, code)
    if line:
        where = f"machine {job.host or '(elastic)'}" if job.elastic else (  # numbered by torchrun's rendezvous
            f"node {job.node_rank}{f' ({job.host})' if job.host else ''}")
        print(f"[trl_ext] {job.label}, {where}: {line}", file=sys.stderr, flush=True)
    if job.node_rank != 0 or job.orchestrator != "Slurm":  # the first Slurm node's is the batch script's to read
        shutil.rmtree(run, ignore_errors=True)
    return code


def machine() -> orchestrators.Job:
    """This machine's job, as the node launcher hands it to its ranks (the orchestrator's, whole, as read).

    Returns:
        The job (one process per machine).

    Raises:
        UsageError: no orchestrator that starts one process per machine.
    """
    job = orchestrators.current()
    if job is None or job.per_rank:
        raise UsageError("python -m trl_ext.launching.node runs one machine of a job that Slurm, SkyPilot, a "
                         "Kubernetes pod with torchrun's PET_* variables or a LeaderWorkerSet started (none of their "
                         "variables is set): under Slurm submit it with sbatch recipes/slurm.sbatch RECIPE [options]",
                         every_rank=True)
    return job


def ending(run: str, code: int) -> tuple[int, str | None]:
    """This node's exit code and its one line, from its processes' exit code and what its ranks left in ``run``.

    Args:
        run: this node's run directory.
        code: the recipe's exit code (negative: killed by that signal).

    Returns:
        ``(code, line)``; no line for a run that finished.
    """
    stops, failures = outcome.stops(run), outcome.failures(run)
    if code == 0 and stops:
        stop = stops[0]
        what = "the time-limit warning" if stop["signal"] == "SIGUSR1" else stop["signal"]
        code = 128 + signal.Signals[stop["signal"]].value
        return code, f"stopped on {what}, with {os.path.basename(stop['checkpoint'])} saved (exit {code})"
    if code == 0:
        return 0, None
    gave_up = [f for f in failures if f["kind"] == outcome.GAVE_UP]
    if gave_up:
        return failure_limit.GAVE_UP, gave_up[0]["error"].removeprefix(f"{GaveUp.__name__}: ")
    errors = [f for f in failures if f["kind"] == outcome.ERROR]
    if errors:
        return restart.ERROR, f"rank {errors[0]['rank']} failed: {errors[0]['error']} (exit {restart.ERROR})"
    if failures:
        return restart.LOST, (f"rank {failures[0]['rank']} lost a peer or its node: {failures[0]['error']} "
                              f"(exit {restart.LOST})")
    if code in (-signal.SIGKILL, 128 + signal.SIGKILL):  # itself, or a rank (trl_ext.launching.accelerate_run)
        return restart.KILLED, f"its processes were killed (SIGKILL) (exit {restart.KILLED})"
    return (code if code > 0 else 128 - code), f"its processes ended with exit code {code}"


if __name__ == "__main__":
    sys.exit(main())
