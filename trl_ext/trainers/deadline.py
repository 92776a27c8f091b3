"""When the time-limit warning is acted on: when the time the job has left comes down to what a stop needs on this run,
measured, plus a margin; until then training goes on.

A stop needs one more step to reach a step boundary and one checkpoint, written in the foreground after a background
save in flight is committed. Both are measured on the run (the longest recent step; the longest checkpoint, with a
background save counted twice: the one in flight and the stop's own), and kept in the job's record so that a requeued
run knows them before it has saved (``ownership``). The margin covers a slower checkpoint than measured:
``need * SAFETY + MARGIN_SECONDS``. Before anything is measured the need is unknown, and the warning is acted on at
once, as without Slurm (where nothing says how much time is left).

The time left comes from Slurm (``squeue -h -j JOB -o %L``), asked when the warning arrives and again every few
seconds after it (the limit may be changed meanwhile), on the first rank only.
"""

import re
import subprocess

SAFETY = 1.5  # a checkpoint may take half again as long as measured (a slower disk, a busier machine)
MARGIN_SECONDS = 30.0  # and the stop's own exit, and Slurm's SIGTERM-to-SIGKILL grace as spare
RECENT_STEPS = 20  # the step time is the longest of the last this many
_TIME_LEFT = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)$")  # squeue's [days-][hours:]minutes:seconds


def parse_time_left(text: str) -> float | None:
    """Seconds from ``squeue``'s ``%L`` (``[days-][hours:]minutes:seconds``); None for ``UNLIMITED``, ``NOT_SET``,
    ``INVALID`` or anything else.

    Args:
        text: what ``squeue -h -o %L`` printed.

    Returns:
        The seconds left, or None.
    """
    match = _TIME_LEFT.match(text.strip())
    if not match:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def time_left(job_id: str) -> float | None:
    """The seconds Slurm gives job ``job_id`` before its time limit (None: no limit, or Slurm cannot be asked).

    Args:
        job_id: the job's id.

    Returns:
        The seconds left, or None.
    """
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%L"], capture_output=True, text=True,
                             timeout=15).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_time_left(out.splitlines()[0]) if out.strip() else None


class Budget:
    """What a stop needs on this run: the longest recent step and the longest checkpoint, in seconds.

    Args:
        save_seconds: a checkpoint's time known beforehand (an earlier run's, from the job's record), or None.
        step_seconds: a step's time known beforehand, or None.
    """

    def __init__(self, save_seconds: float | None = None, step_seconds: float | None = None):
        self.save_seconds = save_seconds
        self.steps = [step_seconds] if step_seconds else []

    def step(self, seconds: float) -> None:
        """One training step took ``seconds``."""
        self.steps = [*self.steps[-(RECENT_STEPS - 1):], seconds]

    def save(self, seconds: float) -> None:
        """A checkpoint took ``seconds`` (a background save: its blocking part plus twice its write)."""
        self.save_seconds = max(seconds, self.save_seconds or 0.0)

    @property
    def step_seconds(self) -> float:
        return max(self.steps, default=0.0)

    @property
    def need(self) -> float | None:
        """Seconds a stop needs (a step, then the checkpoint), or None before a checkpoint was measured."""
        return None if self.save_seconds is None else self.step_seconds + self.save_seconds

    def must_stop(self, left: float | None) -> bool:
        """Whether a stop must start now, with ``left`` seconds before the time limit (None: unknown, so yes).

        Args:
            left: the seconds left.

        Returns:
            True when the time left is within what the stop needs, times ``SAFETY``, plus ``MARGIN_SECONDS``.
        """
        need = self.need
        return left is None or need is None or left <= need * SAFETY + MARGIN_SECONDS

    def threshold(self) -> float | None:
        """The time left at which the stop starts (None: at once)."""
        return None if self.need is None else self.need * SAFETY + MARGIN_SECONDS
