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
