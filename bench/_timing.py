"""The timing lines ``bench/_recovery_worker.py`` prints (``[timing] <event> <unix time> restart <N>``), read back by
the recovery benchmarks (elastic torchrun, Slurm, the memory tier)."""

import re

TIMING = re.compile(r"\[timing\] (\w+) ([\d.]+) restart (\d+)")


def first_events(log: str) -> dict[tuple[str, int], float]:
    """Each event's first time in ``log``, by event and restart (the ranks' own start: "start").

    Args:
        log: a run's output.

    Returns:
        ``{(event, restart): unix time}``.
    """
    found = {}
    for name, when, restart in TIMING.findall(log):
        found.setdefault((name, int(restart)), float(when))
    return found


STEP = re.compile(r"\[step\] (\d+) ([\d.]+)")  # rank 0's steps of the first attempt: bench/_recovery_worker.py
RESUMED = re.compile(r"resuming from (?:step (\d+) in memory|\S*checkpoint-(\d+))")


def resumed_parts(events: dict[tuple[str, int], float]) -> list[tuple[str, float]]:
    """The restarted ranks' parts of a recovery, from their Python up to their first step (restart 1).

    Args:
        events: ``first_events`` of the run's output.

    Returns:
        ``[(part, seconds)]``, in order.
    """
    return [
        ("imports: -> the trainer being built", events[("trainer", 1)] - events[("start", 1)]),
        ("model load: the trainer built", events[("trainer_built", 1)] - events[("trainer", 1)]),
        ("-> train()", events[("train", 1)] - events[("trainer_built", 1)]),
        ("checkpoint chosen and loaded: train() -> loaded", events[("resumed", 1)] - events[("train", 1)]),
        ("-> the first step done", events[("first_step", 1)] - events[("resumed", 1)]),
    ]


def steps_at_the_kill(log: str, killed: float) -> tuple[int, int]:
    """The last step done before the kill and the step the run resumed from (0 where it started over).

    Args:
        log: the run's output.
        killed: when the kill was sent (unix time).

    Returns:
        ``(last step done, resumed step)``.
    """
    done = [int(n) for n, when in STEP.findall(log) if float(when) < killed]
    resumed = RESUMED.search(log)
    return max(done, default=0), int(next(g for g in resumed.groups() if g)) if resumed else 0
