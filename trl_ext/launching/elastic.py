"""One machine of an elastic job whose command is the recipe: pods with a range ``PET_NNODES=MIN:MAX`` (a PyTorchJob's
elastic policy sets it, with ``PET_RDZV_ENDPOINT``; a JobSet or plain Job manifest can). torchrun starts the
machine's ranks in a c10d rendezvous that numbers the machines; when one is lost it restarts the ranks of those left,
which resume by themselves from the run's newest checkpoint (its memory tier first), and it takes in a machine that
joins. accelerate's launch takes a fixed number of machines only, so torchrun runs itself here, and each rank applies
the accelerate config in its own process (``launching.in_process``), as under a torchrun command a user writes.

The rendezvous settings are trl_ext's where the job sets none of its own (``PET_RDZV_CONF``, a key at a time):

- ``last_call_timeout=2``: once the fewest machines are there, torchrun waits this long for more before a round
  starts; its default, 30 s, was most of a recovery's 50 s (docs/launchers.md, "Recovery time"). The job's first
  round waits torchrun's 30 s still (patch ``elastic-first-round``): pods come up seconds apart, and a run whose
  first round started with fewer machines keeps that round's global batch, which the machines that join later may
  not divide (measured: a run started alone at 2 processes x 2 per device, joined 8 s later, could not resume on 4).
  A pod that joins a running job, recreated after a loss, waits 2 s like the rest;
- ``keep_alive_interval=1``: a lost machine counts as gone after 3 missed heartbeats, 5 s apart by default; the new
  round waits for that;
- ``join_timeout``: how long a machine waits for the fewest to arrive: ``TRL_EXT_RENDEZVOUS_TIMEOUT`` (600 s, torchrun's
  own default).

The ranks' restarts are bounded by the job's own ``PET_MAX_RESTARTS``, else by ``TRL_EXT_MAX_FAILURES`` (3), the bound
of every restart trl_ext starts: an error of the run's own is refused on the restart, not repeated.
"""

import sys
from dataclasses import replace
from datetime import timedelta

from trl_ext import patches
from trl_ext.errors import UsageError
from trl_ext.launching import accelerate_run, rendezvous
from trl_ext.placement import failure_limit, orchestrators

RENDEZVOUS = {"last_call_timeout": "2", "keep_alive_interval": "1"}  # trl_ext's, where the job sets none
FIRST_ROUND_LAST_CALL = 30  # seconds: torchrun's own default, for the job's first round
FIRST_ROUND = "--first-round-last-call"  # this module's own option, before torchrun's


def rendezvous_conf(job: orchestrators.Job) -> str:
    """torchrun's ``--rdzv-conf`` for ``job``: trl_ext's settings, each replaced by the job's own where it sets it.

    Args:
        job: an elastic job (``job.elastic``).

    Returns:
        ``key=value,...``.
    """
    settings = {"join_timeout": str(int(rendezvous.timeout_seconds())), **RENDEZVOUS}
    for item in filter(None, (part.strip() for part in job.rendezvous_conf.split(","))):
        key, _, setting = item.partition("=")
        settings[key.strip()] = setting.strip()
    return ",".join(f"{key}={setting}" for key, setting in settings.items())


def per_machine(job: orchestrators.Job, asked: int | None) -> int:
    """The ranks on each machine: ``--num_processes`` (the total at the most machines) divided among the most,
    else the job's (``PET_NPROC_PER_NODE``), else one per GPU (2 on a machine without one)."""
    if asked is None:
        return job.per_node or orchestrators.default_per_node(job)
    if asked % job.nodes:
        raise UsageError(f"--num_processes {asked} does not divide among the elastic job's {job.nodes} machines (its "
                         f"most); give a multiple of {job.nodes}, or PET_NPROC_PER_NODE.", every_rank=True)
    return asked // job.nodes


def command(job: orchestrators.Job, python: str, script: str, args: list[str], asked: int | None = None,
            ) -> tuple[list[str], str]:
    """The torchrun command that starts this machine's ranks, and the line that says it.

    Args:
        job: the elastic job, as the node launcher passed it on.
        python: the interpreter.
        script: the recipe.
        args: its arguments for the ranks (the accelerate config among them).
        asked: ``--num_processes``, if given.

    Returns:
        ``(command, line)``.
    """
    per_node = per_machine(job, asked)
    restarts = job.max_restarts if job.max_restarts is not None else failure_limit.max_failures()
    conf = rendezvous_conf(job)
    first = [] if "last_call_timeout" in job.rendezvous_conf else [FIRST_ROUND, str(FIRST_ROUND_LAST_CALL)]
    cmd = [python, "-m", __name__, *first,
           "--nnodes", f"{job.min_nodes}:{job.nodes}", "--nproc-per-node", str(per_node),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{job.address}:{job.port}", "--rdzv-id", job.run or "none",
           "--rdzv-conf", conf, "--max-restarts", str(restarts), script, *args]
    bound = "the job's own bound" if job.max_restarts is not None else failure_limit.setting()
    line = (f"{job.label}: elastic, {job.min_nodes} to {job.nodes} machines of {per_node} processes, meeting in "
            f"torchrun's rendezvous at {job.address}:{job.port} ({conf}); a lost machine restarts the ranks of those "
            f"left (at most {restarts} times, {bound}), resuming from the newest checkpoint")
    return cmd, line


def first_round_waits(seconds: float):
    """torchrun's c10d rendezvous handler's ``next_rendezvous``, the job's first round with ``last_call_timeout`` at
    ``seconds`` and every later one with the handler's own (patch ``elastic-first-round``). The first round is the one
    still forming in round 0: a machine that joins a running job (a pod recreated after a loss) or rejoins after one
    waits the later rounds' time, so that it never holds the survivors' next round for the first round's wait.

    Args:
        seconds: the first round's ``last_call_timeout``.

    Returns:
        The replacement for ``DynamicRendezvousHandler.next_rendezvous``.
    """
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

    original = DynamicRendezvousHandler.next_rendezvous

    def next_rendezvous(handler):
        holder = handler._state_holder
        holder.sync()  # the job's state in the store, as the join reads it
        if holder.state.round or holder.state.complete:
            return original(handler)
        later = handler._settings
        timeout = later.timeout
        first = replace(later, timeout=RendezvousTimeout(join=timeout.join, last_call=timedelta(seconds=seconds),
                                                         close=timeout.close, heartbeat=timeout.heartbeat))
        holders = (handler, handler._op_executor, holder)  # each holds the settings it reads
        for each in holders:
            each._settings = first
        try:
            return original(handler)
        finally:
            for each in holders:
                each._settings = later

    return next_rendezvous


def main(argv: list[str] | None = None) -> int:
    """``python -m trl_ext.launching.elastic [--first-round-last-call S] <torchrun arguments>``: torchrun in this
    process (``accelerate_run.run_torchrun``), the job's first round waiting ``S`` seconds for more machines.

    Args:
        argv: the arguments (default: the command line).

    Returns:
        0, or the first failed rank's exit code.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] != [FIRST_ROUND]:
        return accelerate_run.run_torchrun(argv)
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    with patches.swapped("elastic-first-round", DynamicRendezvousHandler, "next_rendezvous",
                         first_round_waits(float(argv[1]))):
        return accelerate_run.run_torchrun(argv[2:])


if __name__ == "__main__":
    sys.exit(main())
