"""Restarts bounded by one rule of the run's own, whatever restarts it: after ``TRL_EXT_MAX_FAILURES`` (default 3)
failed attempts in a row without a new committed checkpoint, the next attempt stops before it loads anything, says so
in one line and exits with ``GAVE_UP`` (202), a code no example's orchestrator restarts.

Why our own count: the orchestrators' limits count the wrong thing or nothing. JobSet's ``maxRestarts`` (and a
TrainJob's, through its JobSet) counts every restart, even one after new checkpoints, so a long run on flaky machines
is stopped while it makes progress; SkyPilot's ``recover_on_exit_codes`` and a LeaderWorkerSet's group recreation
have no bound, so a run that keeps failing holds its machines for ever. A failure that came after a new checkpoint
starts the count again: a run that makes progress goes on. A memory checkpoint (``memory_checkpoint_steps``) is
progress too: a run that resumes from memory after each lost machine goes on between its disk checkpoints.

The count lives in the run's record (``ownership``: ``.trl_ext-run`` in its output directory) and, where the run
mirrors its checkpoints, beside them (``mirror.run_record``), so that a recovery onto an empty disk keeps it. Each
attempt after the first looks at how the one before it ended: stopped as planned with a checkpoint (a preemption) is
no failure; anything else (a lost machine, a killed process, a lost peer) is one. Under Slurm the batch script applies
the same rule between attempts with the same setting (``restart``), before it requeues; an attempt does not count
itself there too. A run started again after it gave up was started by a person: its count starts from 0.

Nothing here imports torch or transformers: an attempt decides before it loads anything.
"""

import os
import sys

from trl_ext.errors import GaveUp
from trl_ext.placement import orchestrators, ownership
from trl_ext.settings import environment

__all__ = ["GAVE_UP", "GaveUp", "begin", "count_lost_group", "gave_up_line", "max_failures", "next_count",
           "setting", "started_by_hand", "stopped"]

GAVE_UP = GaveUp.EXIT_CODE  # 202
# Slurm's batch script counts between attempts (``restart``); a Ray driver restarts its group within one attempt
NOT_COUNTED = ("Slurm", "Ray")
_begun: set[str] = set()  # output directories whose attempt this process has counted (a notebook's next trainer)


def max_failures() -> int:
    """Failed attempts in a row without a new checkpoint that a run survives: ``TRL_EXT_MAX_FAILURES``, else the
    former ``TRL_EXT_SLURM_MAX_FAILURES`` or ``TRL_EXT_RAY_MAX_FAILURES``, else 3 (0: the first failure stops it)."""
    return environment.MAX_FAILURES.whole()


def setting() -> str:
    """The variable that set the limit, for the one line (``TRL_EXT_MAX_FAILURES`` when none did)."""
    found = environment.MAX_FAILURES.source()
    return found[0] if found else environment.MAX_FAILURES.name


def next_count(record: dict, newest: int) -> tuple[int, str]:
    """The failures in a row once the attempt before this one is counted, and how that attempt ended.

    Args:
        record: the run's record before this attempt (``failures``, ``checkpoint``, ``stopped``, ``gave_up``).
        newest: the step of the run's newest committed checkpoint now (0: none).

    Returns:
        ``(failures, how)``: ``how`` is "stopped" (a planned stop: not counted), "restarted by hand" (after the run
        gave up: from 0) or "failed".
    """
    if record.get("gave_up"):
        return 0, "restarted by hand"
    progressed = newest > int(record.get("checkpoint", 0))
    failures = 0 if progressed else int(record.get("failures", 0))
    if record.get("stopped"):
        return failures, "stopped"
    return failures + 1, "failed"


def begin(output_dir: str | os.PathLike, limit: int | None = None, newest: int = 0) -> None:
    """At the start of an attempt of a run whose output directory is its own already (an earlier attempt claimed it;
    otherwise nothing): count how the earlier attempt ended, and stop this one if the run failed more than ``limit``
    times in a row without a new checkpoint. Once per process and directory; call it on one process (global rank 0),
    before anything loads.

    Args:
        output_dir: the run's own output directory.
        limit: failed attempts in a row that the run survives (default: ``max_failures()``).
        newest: the newest checkpoint's step where the run keeps them elsewhere too (its mirror's, its memory tier's on
            this machine), if newer than the output directory's.

    Raises:
        GaveUp: the run failed ``limit + 1`` times in a row without a new checkpoint (exit code ``GAVE_UP``).
    """
    key = os.path.abspath(output_dir)
    job = orchestrators.current()
    if (key in _begun or key in ownership.claimed_here or job is None or job.orchestrator in NOT_COUNTED
            or not ownership.is_own(output_dir)):  # claimed here: the run's first attempt in this directory
        return
    record = ownership.record(output_dir)
    _begun.add(key)
    newest = max(newest, ownership.newest_checkpoint(output_dir))
    if job.restart == 0 and job.orchestrator == "torchrun":  # a new torchrun launch, not one of its restarts
        failures, how = 0, "started again"
    else:
        failures, how = next_count(record, newest)
    limit = max_failures() if limit is None else limit
    gave_up, attempt = failures > limit, int(record.get("attempts", 1)) + 1
    ownership.update(output_dir, failures=failures, checkpoint=newest, stopped=False, gave_up=gave_up,
                     attempts=attempt)
    if gave_up:
        raise GaveUp(gave_up_line(job.label, failures, newest, limit, "this attempt stops"))
    said = {"restarted by hand": "started again after it gave up: failures are counted from 0",
            "started again": "a new launch: failures are counted from 0",
            "stopped": "the attempt before it stopped as planned, with a checkpoint",
            "failed": "the attempt before it did not finish"}[how]
    _say(f"{job.label}, attempt {attempt}: {said} ({failures} failed attempt(s) in a row without a new checkpoint; "
         f"the limit is {limit}, {setting()})")


def gave_up_line(label: str, failures: int, newest: int, limit: int, what_stops: str) -> str:
    """The one line of a run that gives up.

    Args:
        label: the run as its orchestrator names it.
        failures: failed attempts in a row without a new checkpoint.
        newest: the step of the newest committed checkpoint (0: none).
        limit: the failures in a row the run survives.
        what_stops: what ends now ("this attempt stops", "the run ends").

    Returns:
        The line.
    """
    newest_text = f"checkpoint-{newest}" if newest else "no checkpoint yet"
    return (f"{label}: {failures} failed attempts in a row without a new checkpoint (newest: {newest_text}); the "
            f"limit is {limit} ({setting()}), so {what_stops} (exit {GAVE_UP}) and is not restarted. The earlier "
            "attempts' logs say why they failed; start the run again once that is fixed: it resumes from its newest "
            "checkpoint, and counts from 0.")


def count_lost_group(output_dir: str | os.PathLike, limit: int) -> tuple[int, int, bool]:
    """Under Ray, where an attempt is one worker group and Ray starts the next itself: count a lost group by the same
    rule as an attempt (``next_count``), in the run's record.

    Args:
        output_dir: the run's own output directory.
        limit: failed attempts in a row that the run survives.

    Returns:
        ``(failures, newest, gave_up)``: the failures in a row, the newest committed checkpoint's step, and whether
        the run gives up (more failures in a row than ``limit``).
    """
    newest = ownership.newest_checkpoint(output_dir)
    failures, _ = next_count({**ownership.record(output_dir), "stopped": False}, newest)
    gave_up = failures > limit
    ownership.update(output_dir, failures=failures, checkpoint=newest, stopped=False, gave_up=gave_up)
    return failures, newest, gave_up


def started_by_hand(output_dir: str | os.PathLike, run: str) -> None:
    """A Ray driver's start: a run that gave up and is started again was started by a person, and counts from 0
    (``begin`` does this for an attempt elsewhere).

    Args:
        output_dir: the run's output directory.
        run: the run's identity (a directory of another run is left alone).
    """
    if ownership.run_of(output_dir) == run and ownership.record(output_dir).get("gave_up"):
        ownership.update(output_dir, failures=0, gave_up=False)


def _say(line: str) -> None:
    print(f"[trl_ext] {line}", file=sys.stderr, flush=True)


def stopped(output_dir: str | os.PathLike) -> None:
    """Record that this attempt stopped as planned, with a checkpoint (a preemption): the next one does not count it.

    Args:
        output_dir: the run's output directory (nothing is written in a directory that is not this run's).
    """
    ownership.update(output_dir, stopped=True)
