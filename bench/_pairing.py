"""How a bench pairs TRL's runs with trl_ext's, so that a ratio comes with its noise (issue 71). Used by
bench/overhead.py (paired steps, whole runs) and by bench/gpu.py, hence the device check's throughput step:

- **alternated repeats**: repeat 0 runs TRL first, repeat 1 trl_ext first, and so on, so that whatever favours a
  position (the first run of a process, caches warmed by the run before, load that drifts) favours each side alike;
- **an A/A control**: the same pairing with TRL's trainer on both sides (the "trl_ext" side runs TRL too): its
  ratios are what the pairing produces from no difference at all;
- **a ratio read beside its control**: the goal missed by no more than the control strayed from 1.00 is "within
  noise", not a miss.
- **paired steps** (``Baton``): two trainers in one process take turns, one step each, so that every step of one
  side has a step of the other beside it (bench/overhead.py's one-process runs, the device check's diagnose step).

Pure Python, no torch: tests/unit/test_pairing.py runs this file, which answers JSON requests on stdin (``main``),
since the tests do not import bench/ (tests/unit/test_layout.py).
"""

import json
import statistics
import sys
import threading

SIDES = ("trl", "trl_ext")


class Baton:
    """Strict turns between named threads; a finished thread drops out of the rotation."""

    def __init__(self, names: list[str]):
        self.names, self.turn, self.finished = names, names[0], set()
        self.cond = threading.Condition()

    def pass_and_wait(self, me: str) -> None:
        with self.cond:
            self._advance(me)
            self.cond.wait_for(lambda: self.turn == me)

    def finish(self, me: str) -> None:
        with self.cond:
            self.finished.add(me)
            self._advance(me)

    def _advance(self, me: str) -> None:
        waiting = [n for n in self.names if n != me and n not in self.finished]
        self.turn = waiting[0] if waiting else me
        self.cond.notify_all()


def train_in_turns(trainers: dict, baton: Baton) -> None:
    """Each trainer's ``train()`` in a thread of its own, in turns through ``baton`` (their callbacks pass it at each
    step's start); a trainer that stops drops out of the rotation, so that the other is never left waiting.

    Args:
        trainers: ``{name: trainer}``, the names ``baton`` rotates.
        baton: the turns.

    Raises:
        BaseException: the first error a trainer raised, once both threads are done.
    """
    errors = []

    def train(name: str) -> None:
        try:
            trainers[name].train()
        except BaseException as exc:  # noqa: BLE001 - raised by the calling thread
            errors.append(exc)
        finally:
            baton.finish(name)

    threads = [threading.Thread(target=train, args=(name,)) for name in trainers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def order(repeat: int) -> tuple[str, str]:
    """The sides in the order repeat ``repeat`` runs them.

    Args:
        repeat: the repeat's index, from 0.

    Returns:
        ``("trl", "trl_ext")`` for an even repeat, ``("trl_ext", "trl")`` for an odd one.
    """
    return SIDES if repeat % 2 == 0 else SIDES[::-1]


def summary(ratios: list[float]) -> dict:
    """Ratios of trl_ext's side over TRL's (one per repeat, or per paired step), summed up.

    Args:
        ratios: at least one ratio.

    Returns:
        ``{"ratios", "median", "low", "high"}``.
    """
    return {"ratios": list(ratios), "median": statistics.median(ratios), "low": min(ratios), "high": max(ratios)}


def span(found: dict | None) -> str:
    """A summary's range as the tables print it, e.g. ``"0.973-1.012"`` (``"-"`` for None)."""
    return "-" if found is None else f"{found['low']:.3f}-{found['high']:.3f}"


def noise(control: dict) -> float:
    """How far the A/A control strayed from 1.00: its ratio farthest from it. This counts the pairing's bias (an A/A
    median away from 1.00: the second-built side runs faster...) as well as its spread.

    Args:
        control: the A/A control's ``summary``.

    Returns:
        The largest ``|ratio - 1|``.
    """
    return max(abs(r - 1) for r in control["ratios"])


def verdict(median: float, goal: float, control: dict | None) -> dict:
    """Whether a median ratio misses its goal, read beside the A/A control.

    Args:
        median: the median ratio trl_ext / TRL over the repeats.
        goal: the largest ratio the goal allows (1.02).
        control: the A/A control's ``summary``, or None where none ran.

    Returns:
        ``{"verdict", "miss", "noise", "detail"}``: ``verdict`` is "met" (median <= goal), "within noise" (above the
        goal by no more than the control's ``noise``), "miss", or "miss (no control)"; ``miss`` is median - goal;
        ``detail`` is one line.
    """
    miss = median - goal
    spread = None if control is None else noise(control)
    if miss <= 0:
        found, detail = "met", f"{median:.3f}x <= {goal}x"
    elif spread is None:
        found, detail = "miss (no control)", f"{median:.3f}x > {goal}x; no A/A control to read it against"
    elif spread >= miss:
        found, detail = "within noise", (f"{median:.3f}x is {miss:.3f} above {goal}x, and the A/A control strayed "
                                         f"{spread:.3f} from 1.00 (TRL against TRL): not a miss")
    else:
        found, detail = "miss", (f"{median:.3f}x is {miss:.3f} above {goal}x, more than the A/A control strayed from "
                                 f"1.00 ({spread:.3f})")
    return {"verdict": found, "miss": miss, "noise": spread, "detail": detail}


def main() -> None:
    """Answer one JSON request on stdin (what tests/unit/test_pairing.py sends) with JSON on stdout:
    ``{"order": [repeat, ...], "summary": [[ratio, ...], ...], "verdict": [[median, goal, control ratios or None],
    ...]}`` -> the same keys with ``order``'s, ``summary``'s and ``verdict``'s answers."""
    request = json.load(sys.stdin)
    print(json.dumps({
        "order": [order(r) for r in request.get("order", [])],
        "summary": [summary(r) for r in request.get("summary", [])],
        "verdict": [verdict(m, g, None if c is None else summary(c)) for m, g, c in request.get("verdict", [])]}))


if __name__ == "__main__":
    main()
