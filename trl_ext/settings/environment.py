"""Every ``TRL_EXT_*`` environment variable a user sets, read here, each with its one default.

A setting that holds what it should not (a word where seconds go) is one line and exit code 1 (``UsageError``), on
every rank, before anything starts. The variables that one trl_ext process hands down to the processes it starts
(``HANDED_DOWN``: its launch decision, its job, its machine's run directory) are no settings: each is named in the one
module that writes and reads it, listed here. ``tests/unit/test_layout.py`` fails on a ``TRL_EXT_*`` name anywhere else.
"""

import os
from dataclasses import dataclass
from pathlib import Path

from trl_ext.errors import UsageError


@dataclass(frozen=True)
class Setting:
    """One environment setting: its name, its default, and the names it had before (still read where it is unset)."""

    name: str
    default: float | int | str | None
    what: str
    former: tuple[str, ...] = ()

    def source(self) -> tuple[str, str] | None:
        """The variable that set it and its text, stripped: the setting's name first, then its former names; None
        when none is set (a blank value is unset)."""
        for name in (self.name, *self.former):
            text = os.environ.get(name, "").strip()
            if text:
                return name, text
        return None

    def text(self) -> str | None:
        """The value as set, else the default."""
        found = self.source()
        return found[1] if found else self.default

    def number(self, minimum: float = 0.0) -> float:
        """The value as a number of seconds (or a count) ``>= minimum``, else the default.

        Raises:
            UsageError: a value that is not such a number.
        """
        found = self.source()
        if found is None:
            return self.default
        try:
            value = float(found[1])
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise UsageError(f"{found[0]}={found[1]!r} is not a number >= {minimum:g} (it sets {self.what}).",
                             every_rank=True)
        return value

    def whole(self, minimum: int = 0, maximum: int | None = None) -> int:
        """The value as a whole number in ``[minimum, maximum]``, else the default.

        Raises:
            UsageError: a value that is not such a number.
        """
        found = self.source()
        if found is None:
            return self.default
        value = int(found[1]) if found[1].isdigit() else None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            bound = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
            raise UsageError(f"{found[0]}={found[1]!r} is not a whole number {bound} (it sets {self.what}).",
                             every_rank=True)
        return value


MAX_FAILURES = Setting(
    "TRL_EXT_MAX_FAILURES", 3, "the failed attempts in a row without a new checkpoint that a run survives; 0: none",
    former=("TRL_EXT_SLURM_MAX_FAILURES", "TRL_EXT_RAY_MAX_FAILURES"))
RENDEZVOUS_TIMEOUT = Setting(
    "TRL_EXT_RENDEZVOUS_TIMEOUT", 600.0,
    "the seconds the machines of a job wait for each other before their ranks start")
RAY_WAIT = Setting(
    "TRL_EXT_RAY_WAIT_S", 300.0, "the seconds a Ray run waits for the cluster to have room for its minimum; 0: none")
RAY_STANDBY = Setting(
    "TRL_EXT_RAY_STANDBY", 1,
    "whether a Ray run keeps a standby process per rank on each node, its imports done, for a restarted group; 0: none")
RUN_ID = Setting(
    "TRL_EXT_RUN_ID", None, "the run's identity, where the orchestrator's own is not the one to use")
MASTER_PORT = Setting(
    "TRL_EXT_MASTER_PORT", None, "the machines' meeting port, where the orchestrator names none")
CACHE = Setting(
    "TRL_EXT_CACHE", str(Path.home() / ".cache" / "trl_ext"), "where the embedded models and data are built once")

MEMORY_DIR = Setting(
    "TRL_EXT_MEMORY_DIR", "/dev/shm/trl_ext",
    "where a machine keeps its memory checkpoints (memory_checkpoint_steps): node-local shared memory by default")

SETTINGS = (MAX_FAILURES, RENDEZVOUS_TIMEOUT, RAY_WAIT, RAY_STANDBY, RUN_ID, MASTER_PORT, CACHE, MEMORY_DIR)

# name -> the module that writes it for the processes it starts, and reads it there
HANDED_DOWN = {
    "TRL_EXT_LAUNCH": "trl_ext/launching/decision.py",
    "TRL_EXT_NODE": "trl_ext/placement/orchestrators/job.py",
    "TRL_EXT_RUN_DIR": "trl_ext/placement/ownership.py",
    "TRL_EXT_HOSTED_RANK": "trl_ext/process/hosted.py",
    "TRL_EXT_CHECKED_DATASETS": "trl_ext/data/input_checks.py",
}
