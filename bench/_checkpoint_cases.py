"""Background checkpoints against the disk's pace (bench/_device_whole_checkpoints.py, issue 71 point 4): the two
cases a user meets, each measured against the foreground run of the same process (the anchor).

- ``spaced``: the save interval picked from the measured write time, at least ``SPACING`` times it
  (``pick_interval``): each checkpoint's write is committed before the next is due, so a checkpoint holds training
  only for its own save call and copies.
- ``faster``: checkpoints due faster than the disk writes them. trl_ext keeps at most one checkpoint in flight and
  skips none: ``take`` first waits for the previous checkpoint's write to be committed
  (``Checkpoints.wait_for_writes``), and that wait is logged as ``checkpoint/held_previous_s``. Training is then held
  about (write time - interval) at every checkpoint.

The final save (the run's last checkpoint, always in the foreground: nothing trains after it) is reported apart: it
is a foreground save, plus the wait for the checkpoint before it when that one is still being written.
"""

import math
import statistics

SPACING = 2.0  # the spaced case's interval, in write times


def pick_interval(write_s: float, step_s: float, spacing: float = SPACING) -> int:
    """The save interval, in steps, for checkpoints at least ``spacing`` write times apart.

    Args:
        write_s: a checkpoint's measured write time (files written, synced, checked, committed).
        step_s: a training step's measured time.
        spacing: the interval in write times.

    Returns:
        ``save_steps``, at least 2.
    """
    return max(2, math.ceil(spacing * write_s / max(step_s, 1e-9)))


def _median(values: list) -> float | None:
    return statistics.median(values) if values else None


def case(run: dict, anchor: dict) -> dict:
    """One background run as a case: its interval against its writes, what each checkpoint held, the final save
    apart, and the ratios against the foreground run.

    Args:
        run: a run of bench/_device_whole_checkpoints.py (``steps``, ``logged``, ``summary``).
        anchor: the foreground run of the same process.

    Returns:
        ``{"interval_s", "write_s", "interval_over_write", "held_s", "waited_previous_s", "final_held_s",
        "final_waited_previous_s", "held_vs_foreground", "final_vs_foreground", "committed", "expected",
        "what_happened"}``: ``interval_s`` is ``save_steps`` x the run's median step, ``write_s`` the median
        background write; ``held_s`` and ``waited_previous_s`` per background checkpoint (all but the last); the times
        measured, ``waited_*`` as trl_ext logs it.
    """
    s, fg = run["summary"], anchor["summary"]
    # how often checkpoints come due: save_steps steps of training (the run's median step; the time a checkpoint
    # holds training is not counted, or a wait for the previous write would lengthen the interval it comes from)
    interval = run["save_steps"] * statistics.median(end - start for _, start, end in run["steps"])
    write = _median(s["write_s"])
    waited = [e.get("checkpoint/held_previous_s", 0.0) for e in run["logged"]]
    held, fg_held = s["held_s"], fg["held_s"]
    found = {
        "interval_s": interval, "write_s": write, "interval_over_write": interval / write if write else None,
        "held_s": held[:-1], "waited_previous_s": waited[:-1],
        "final_held_s": held[-1] if held else None, "final_waited_previous_s": waited[-1] if waited else None,
        "held_vs_foreground": (_median(held[:-1]) / max(_median(fg_held[:-1]), 1e-9)
                               if len(held) > 1 and len(fg_held) > 1 else None),
        "final_vs_foreground": held[-1] / max(fg_held[-1], 1e-9) if held and fg_held else None,
        "committed": sorted(run["checkpoints"], key=lambda n: int(n.rpartition("-")[2])),
        "expected": [f"checkpoint-{c}" for c in s["checkpoint_steps"]],
    }
    found["what_happened"] = what_happened(found)
    return found


def what_happened(c: dict) -> str:
    """One line: whether checkpoints waited for the previous write, skipped any, and what to set."""
    skipped = sorted(set(c["expected"]) - set(c["committed"]))
    waits = [w for w in c["waited_previous_s"][1:] if w > 0]  # the first background checkpoint has none before it
    final = c["final_waited_previous_s"] or 0.0
    parts = ["skipped " + ", ".join(skipped) if skipped else "none skipped"]
    if waits:
        parts.append(f"{len(waits)} background checkpoint(s) after the first waited {statistics.median(waits):.3g} s "
                     "(median) for the previous write to be committed (checkpoint/held_previous_s)")
    else:
        parts.append("no background checkpoint waited for the previous write")
    if final:
        parts.append(f"the final save waited {final:.3g} s for the one before it")
    if waits or final:
        parts.append("checkpoints came faster than the disk wrote them and training ran at its pace: set save_steps "
                     "to at least 2 x checkpoint/write_s / step time")
    else:
        parts.append("each held training only for its own save call")
    return "; ".join(parts)


def rows(cases: dict) -> list[dict]:
    """The cases as table rows.

    Args:
        cases: name -> ``case(...)``.

    Returns:
        One row per case.
    """
    def times(values):
        return ", ".join(f"{v:.3f}" for v in values) or "-"

    return [{"case": name, "interval s": c["interval_s"], "write s (median)": c["write_s"],
             "interval / write": c["interval_over_write"], "held s, each background checkpoint": times(c["held_s"]),
             "waited for the previous s (logged)": times(c["waited_previous_s"]),
             "held vs foreground's (median)": c["held_vs_foreground"], "final save held s": c["final_held_s"],
             "final save vs foreground's": c["final_vs_foreground"], "what happened": c["what_happened"]}
            for name, c in cases.items()]
