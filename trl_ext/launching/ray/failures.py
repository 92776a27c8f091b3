"""How a Ray Train worker group's failure is told: a lost worker or node, which a restart fixes (Ray's
``FailureConfig``), or an error of the run's own (a bug, bad input, a full disk), which a restart would repeat.

Each worker raises what ended it as an ``errors.RankError`` whose ``kind`` it decided where the exception and its
chain are (``placement.outcome.kind_of``: a broken collective means a lost peer). Ray's own errors for a worker it
lost (a failed health check, an actor that died with its node) carry no kind: they are lost workers. A lost worker
decides over an error, as Ray's own policy decides for a preemption: once one rank dies, the others fail in their
collectives with errors of every shape.

Nothing here imports Ray.
"""

import re

from trl_ext.errors import RankError
from trl_ext.placement.outcome import ERROR, PEER

_NODE_ID = re.compile(r"node_id='([0-9a-f]+)'")


def first_line(exc: BaseException) -> str:
    """``Class: first line`` of an exception (a ``UsageError``'s own one line)."""
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    if isinstance(exc, SystemExit):
        return text or f"exit {exc.code}"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def verdict(worker_exceptions: dict) -> tuple[str, str]:
    """The kind of a worker group's failure and its line.

    Args:
        worker_exceptions: world rank -> the exception Ray reports for that worker.

    Returns:
        ``(PEER, line)`` when a worker or node was lost (some rank lost a peer, or Ray lost the worker itself);
        ``(ERROR, line)`` when the ranks that failed failed on their own, the line naming the first.
    """
    ranks = sorted(worker_exceptions)
    ours = {rank: worker_exceptions[rank] for rank in ranks if isinstance(worker_exceptions[rank], RankError)}
    lost = [rank for rank in ranks if rank not in ours]
    if lost:
        return PEER, f"Ray lost rank {lost[0]}'s worker: {_ray_line(worker_exceptions[lost[0]])}"
    peers = [rank for rank, exc in ours.items() if exc.kind == PEER]
    if peers:
        return PEER, str(ours[peers[0]])
    return ERROR, str(ours[ranks[0]])


def lost_nodes(worker_exceptions: dict) -> set[str]:
    """The ids of the nodes whose workers Ray could no longer reach (its health check found the actor unavailable,
    not dead: a dead worker on a live node is reported dead at once), named in Ray's health-check errors."""
    unreachable = [exc for exc in worker_exceptions.values() if not isinstance(exc, RankError)
                   and type(getattr(exc, "health_check_failure", None)).__name__ == "ActorUnavailableError"]
    return {node for exc in unreachable for node in _NODE_ID.findall(str(exc))}


def _ray_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__
