"""The machines of a job meet before their ranks start, within a stated time, or say which one never came.

torchrun's static rendezvous waits for a missing machine in silence (600 s by default) before its agent starts any
rank, and then fails with a store timeout that names no machine. Here each machine's launcher first checks in at the
first machine (a TCP store on the rendezvous port + 1), says which machines it still waits for after
``FIRST_SAY_SECONDS`` and then every ``SAY_SECONDS``,
and gives up after ``TRL_EXT_RENDEZVOUS_TIMEOUT`` seconds (default 600) naming them. torchrun's rendezvous then starts
with every machine there.
"""

import socket
import time
from datetime import timedelta

from trl_ext.errors import SetupError
from trl_ext.settings import environment

TIMEOUT_ENV = environment.RENDEZVOUS_TIMEOUT.name
FIRST_SAY_SECONDS = 5.0  # a meeting that takes longer says so (a usual one is silent)
SAY_SECONDS = 15.0  # then how often a waiting machine says what it waits for
POLL_SECONDS = 0.2
CONNECT_SECONDS = 5.0  # one try to reach the first machine; tried again until the bound
PREFIX = "trl_ext/rendezvous"


def timeout_seconds() -> float:
    """The bound on the meeting (``TRL_EXT_RENDEZVOUS_TIMEOUT``, seconds; default 600)."""
    return environment.RENDEZVOUS_TIMEOUT.number()


def _connect(job, port: int, deadline: float, say):
    from torch.distributed import TCPStore  # imported by ``gather`` before the bound starts

    if job.node_rank == 0:
        return TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                        timeout=timedelta(seconds=max(deadline - time.monotonic(), 1.0)))
    said, every = time.monotonic(), FIRST_SAY_SECONDS
    while True:
        try:
            return TCPStore(job.address, port, is_master=False,
                            timeout=timedelta(seconds=min(CONNECT_SECONDS, max(deadline - time.monotonic(), 0.5))))
        except (RuntimeError, OSError, ValueError) as exc:  # not listening yet, or its name does not resolve yet
            now = time.monotonic()
            if now >= deadline:
                raise SetupError(f"machine {job.node_rank} of {job.nodes} could not reach the first machine at "
                                 f"{job.address}:{port} within {timeout_seconds():.0f} s ({TIMEOUT_ENV}): "
                                 f"{str(exc).strip().splitlines()[0][:200]}") from None
            if now - said >= every:
                say(f"machine {job.node_rank}: waiting for the first machine at {job.address}:{port}")
                said, every = now, SAY_SECONDS
            time.sleep(POLL_SECONDS)


def gather(job, say=print) -> float:
    """Wait until every machine of ``job`` has checked in, or raise after the bound.

    Args:
        job: this machine's ``orchestrators.Job`` (more than one machine).
        say: prints one line (the machines still awaited, every ``SAY_SECONDS``).

    Returns:
        The seconds the meeting took.

    Raises:
        SetupError: a machine that did not come within ``TRL_EXT_RENDEZVOUS_TIMEOUT`` seconds, named.
    """
    import torch.distributed  # noqa: F401 - torch's import (seconds on a loaded machine) is not the meeting's time

    start = time.monotonic()
    bound = timeout_seconds()
    deadline = start + bound
    port = job.port + 1
    store = _connect(job, port, deadline, say)
    store.set(f"{PREFIX}/{job.node_rank}", socket.gethostname())
    said, every = start, FIRST_SAY_SECONDS
    while True:
        missing = [r for r in range(job.nodes) if not store.check([f"{PREFIX}/{r}"])]
        if not missing:
            break
        now = time.monotonic()
        where = f"{job.address}:{port}"  # the meeting's own port (the rendezvous port + 1)
        if now >= deadline:
            raise SetupError(f"waited {bound:.0f} s for {len(missing)} of {job.nodes} machines at {where}: machine(s) "
                             f"{', '.join(map(str, missing))} never arrived ({TIMEOUT_ENV} sets the bound)")
        if now - said >= every:
            say(f"waiting for {len(missing)} of {job.nodes} machines at {where} (machine(s) "
                f"{', '.join(map(str, missing))}; {deadline - now:.0f} s left)")
            said, every = now, SAY_SECONDS
        time.sleep(POLL_SECONDS)
    store.add(f"{PREFIX}/done", 1)
    if job.node_rank == 0:  # the others read the last count from this store: it stays until they have
        until = time.monotonic() + 60
        while int(store.add(f"{PREFIX}/done", 0)) < job.nodes and time.monotonic() < until:
            time.sleep(POLL_SECONDS)
    del store
    return time.monotonic() - start
