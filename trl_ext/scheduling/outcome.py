"""How a rank of a Slurm job ended, left for its node's launcher: a planned stop (the signal, the step, the checkpoint
it saved) or a failure, told apart where it is known: a lost peer or node (its collectives broke: a peer died, its
node went away, the network dropped) or an error of its own (a bug, bad data, a full disk). The rank writes one small
file into its node's run directory (``ownership.RUN_ENV``) as it ends; the node's launcher reads them all (``node``),
and the batch script decides from every node's answer (``restart``).

Told apart by the exception, never by the log: torch's distributed errors (``DistNetworkError``, ``DistStoreError``,
``DistBackendError``) and the transports' words for a broken connection (gloo's "Connection closed by peer", NCCL's
"remote process exited"), anywhere in the exception's chain, mean a lost peer; anything else is the rank's own error.
"""

import json
import os
import sys
from pathlib import Path

from trl_ext.scheduling.ownership import RUN_ENV

PEER, ERROR = "peer", "error"
# What the transports say when the other end of a collective is gone (gloo, NCCL, TCPStore, sockets).
PEER_SIGNS = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited",
              "ncclremoteerror", "communicator was aborted", "connection refused", "no route to host",
              "socket timeout", "recv failed", "send failed")
_DIST_ERRORS = ("DistNetworkError", "DistStoreError", "DistBackendError")
_watching = False


def kind_of(exc: BaseException) -> str:
    """``PEER`` when ``exc`` (or an exception in its chain) says a collective lost its other end, else ``ERROR``.

    Args:
        exc: the exception that ended the rank.

    Returns:
        ``PEER`` or ``ERROR``.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if type(exc).__name__ in _DIST_ERRORS or any(sign in str(exc).lower() for sign in PEER_SIGNS):
            return PEER
        exc = exc.__cause__ or exc.__context__
    return ERROR


def record(exc: BaseException, run_dir: str | os.PathLike | None = None) -> str | None:
    """Leave this rank's failure for its node's launcher: ``failed-<pid>.json`` in the run directory.

    Args:
        exc: the exception that ends the rank.
        run_dir: the node's run directory (default: ``$TRL_EXT_SLURM_RUN``; nothing is written without one).

    Returns:
        The kind recorded, or None when there is no run directory.
    """
    run_dir = run_dir or os.environ.get(RUN_ENV)
    if not run_dir or not os.path.isdir(run_dir):
        return None
    kind = kind_of(exc)
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    entry = {"kind": kind, "error": f"{type(exc).__name__}: {first}" if first else type(exc).__name__,
             "rank": os.environ.get("RANK", "0")}
    path = Path(run_dir) / f"failed-{os.getpid()}.json"
    try:
        path.write_text(json.dumps(entry))
    except OSError:
        return None
    return kind


def failures(run_dir: str | os.PathLike) -> list[dict]:
    """Every failure the ranks of this node recorded in ``run_dir``.

    Args:
        run_dir: the node's run directory.

    Returns:
        ``{"kind", "error", "rank"}`` per failed rank (none when they all ended cleanly or left nothing).
    """
    return _read(run_dir, "failed-*.json")


def stopped(signal_name: str, step: int, checkpoint: str, run_dir: str | os.PathLike | None = None) -> bool:
    """Leave this rank's planned stop for its node's launcher: ``stopped-<pid>.json`` in the run directory.

    Args:
        signal_name: the signal all ranks agreed to stop on (``SIGTERM``, ``SIGUSR1``).
        step: the step of the checkpoint saved.
        checkpoint: its path.
        run_dir: the node's run directory (default: ``$TRL_EXT_SLURM_RUN``).

    Returns:
        Whether it was recorded (False outside a Slurm node's launcher).
    """
    run_dir = run_dir or os.environ.get(RUN_ENV)
    if not run_dir or not os.path.isdir(run_dir):
        return False
    entry = {"signal": signal_name, "step": step, "checkpoint": checkpoint, "rank": os.environ.get("RANK", "0")}
    try:
        (Path(run_dir) / f"stopped-{os.getpid()}.json").write_text(json.dumps(entry))
    except OSError:
        return False
    return True


def stops(run_dir: str | os.PathLike) -> list[dict]:
    """Every planned stop the ranks of this node recorded in ``run_dir``.

    Args:
        run_dir: the node's run directory.

    Returns:
        ``{"signal", "step", "checkpoint", "rank"}`` per rank that stopped as planned.
    """
    return _read(run_dir, "stopped-*.json")


def _read(run_dir, pattern: str) -> list[dict]:
    found = []
    for path in sorted(Path(run_dir).glob(pattern)):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return found


def watch() -> None:
    """In a rank of a Slurm node (under ``scheduling.node``), record the exception that ends the process; elsewhere,
    nothing. Idempotent; the previous hook still runs (the traceback is printed as before)."""
    global _watching
    if _watching or not os.environ.get(RUN_ENV):
        return
    _watching = True
    previous = sys.excepthook

    def hook(kind, exc, tb):
        if not isinstance(exc, KeyboardInterrupt):
            record(exc)
        previous(kind, exc, tb)

    sys.excepthook = hook
