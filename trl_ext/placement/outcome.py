"""How a rank ended, left for whoever decides what happens next: a planned stop (the signal, the step, the checkpoint
it saved) or a failure, told apart where it is known: a lost peer or node (its collectives broke: a peer died, its
node went away, the network dropped) or an error of its own (a bug, bad data, a full disk). The rank writes one small
file as it ends:

- into its machine's run directory (``ownership.RUN_ENV``), under the node launcher: the launcher reads them all
  (``node``), and under Slurm the batch script decides from every node's answer (``restart``);
- into its output directory, for a run that its orchestrator may restart (torchrun's ``--max-restarts``, an elastic
  job): the next attempt reads it and refuses at once to repeat an error of the run's own (``refuse_after_error``);
  restarting cannot fix a bug, and a lost machine is what a restart is for.

Told apart by the exception, never by the log: torch's distributed errors (``DistNetworkError``, ``DistStoreError``,
``DistBackendError``) and the transports' words for a broken connection (gloo's "Connection closed by peer", NCCL's
"remote process exited"), anywhere in the exception's chain, mean a lost peer; anything else is the rank's own error.
"""

import json
import os
import shutil
import sys
from pathlib import Path

from trl_ext import errors
from trl_ext.errors import UsageError
from trl_ext.placement import orchestrators, ownership
from trl_ext.placement.ownership import RUN_ENV
from trl_ext.process.ranks import env_rank

PEER, ERROR = "peer", "error"
GAVE_UP = errors.GAVE_UP  # failure_limit stopped the run (errors.GaveUp's kind)
ATTEMPTS = ".trl_ext-attempts"  # in an output directory: how each attempt of a restarted run ended, one folder each
# What the transports say when the other end of a collective is gone (gloo, NCCL, TCPStore, sockets).
PEER_SIGNS = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited",
              "ncclremoteerror", "communicator was aborted", "connection refused", "no route to host",
              "socket timeout", "recv failed", "send failed")
_DIST_ERRORS = ("DistNetworkError", "DistStoreError", "DistBackendError")
_watching = [False, None]  # the hook is installed; the output directory whose attempts it records


def kind_of(exc: BaseException) -> str:
    """``PEER`` when ``exc`` (or an exception in its chain) says a collective lost its other end, else ``ERROR``.

    Args:
        exc: the exception that ended the rank.

    Returns:
        ``PEER``, ``ERROR``, or ``GAVE_UP`` for ``errors.GaveUp``.
    """
    if getattr(exc, "kind", None) == GAVE_UP:
        return GAVE_UP
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if type(exc).__name__ in _DIST_ERRORS or any(sign in str(exc).lower() for sign in PEER_SIGNS):
            return PEER
        exc = exc.__cause__ or exc.__context__
    return ERROR


def _entry(exc: BaseException) -> dict:
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return {"kind": kind_of(exc), "error": f"{type(exc).__name__}: {first}" if first else type(exc).__name__,
            "rank": str(env_rank())}


def record(exc: BaseException, run_dir: str | os.PathLike | None = None) -> str | None:
    """Leave this rank's failure for its node's launcher: ``failed-<pid>.json`` in the run directory.

    Args:
        exc: the exception that ends the rank.
        run_dir: the node's run directory (default: ``$TRL_EXT_RUN_DIR``; nothing is written without one).

    Returns:
        The kind recorded, or None when there is no run directory.
    """
    run_dir = run_dir or os.environ.get(RUN_ENV)
    if not run_dir or not os.path.isdir(run_dir):
        return None
    entry = _entry(exc)
    path = Path(run_dir) / f"failed-{os.getpid()}.json"
    try:
        path.write_text(json.dumps(entry))
    except OSError:
        return None
    return entry["kind"]


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
        run_dir: the node's run directory (default: ``$TRL_EXT_RUN_DIR``).

    Returns:
        Whether it was recorded (False outside a Slurm node's launcher).
    """
    run_dir = run_dir or os.environ.get(RUN_ENV)
    if not run_dir or not os.path.isdir(run_dir):
        return False
    entry = {"signal": signal_name, "step": step, "checkpoint": checkpoint, "rank": str(env_rank())}
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


def _attempt(job) -> int:
    return job.restart if job is not None else 0


def record_attempt(exc: BaseException, output_dir: str | os.PathLike) -> bool:
    """Leave this rank's failure in the run's output directory, under this attempt's number, for the next attempt.

    Args:
        exc: the exception that ends the rank.
        output_dir: the run's output directory (its own: marked for this run).

    Returns:
        Whether it was recorded (not for a directory that is not this run's).
    """
    if not ownership.is_own(output_dir):
        return False
    folder = Path(output_dir) / ATTEMPTS / str(_attempt(orchestrators.current()))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"failed-{env_rank()}-{os.getpid()}.json").write_text(json.dumps(_entry(exc)))
    except OSError:
        return False
    return True


def refuse_after_error(output_dir: str | os.PathLike) -> None:
    """At the start of a restarted run's attempt, in its own output directory: refuse at once when an earlier attempt
    ended in an error of its own (the first attempt clears what an earlier launch of the run left).

    Args:
        output_dir: the run's own output directory.

    Raises:
        UsageError: an earlier attempt's error, on every rank that reads it.
    """
    job = orchestrators.current()
    attempt = _attempt(job)
    attempts = Path(output_dir) / ATTEMPTS
    if attempt == 0:
        shutil.rmtree(attempts, ignore_errors=True)  # a new launch of the run: its restarts count from here
        return
    for earlier in sorted((int(p.name) for p in attempts.glob("*") if p.name.isdigit()), reverse=True):
        errors = [f for f in _read(attempts / str(earlier), "failed-*.json") if f.get("kind") == ERROR]
        if earlier < attempt and errors:
            first = errors[0]
            raise UsageError(f"{job.label}, restart {attempt}: attempt {earlier} ended in an error of its own on rank "
                             f"{first['rank']} ({first['error']}); a restart would repeat it, so this one stops. Fix "
                             "it, then start the run again (it resumes from its newest checkpoint).")


def watch(output_dir: str | os.PathLike | None = None) -> None:
    """Record the exception that ends this process: for its machine's launcher (under ``launching.node``) and, once
    ``output_dir`` is given, for the next attempt of a run its orchestrator may restart. Idempotent; the previous hook
    still runs (the traceback is printed as before).

    Args:
        output_dir: the run's output directory, once chosen.
    """
    if output_dir is not None:
        _watching[1] = output_dir
    if _watching[0]:
        return
    _watching[0] = True
    previous = sys.excepthook

    def hook(kind, exc, tb):
        if not isinstance(exc, KeyboardInterrupt):
            record(exc)
            if _watching[1] is not None:
                record_attempt(exc, _watching[1])
        previous(kind, exc, tb)

    sys.excepthook = hook
