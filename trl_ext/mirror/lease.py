"""Which run writes to a mirror: a run marker at its top (``trl_ext-mirror-run.json``), renewed while the run trains,
so that two runs never write to the same prefix.

Object stores offer no lock that every one of them supports, so the marker is a lease: a run takes it when it is
absent, released or expired (not renewed for ``LEASE_SECONDS``), or when its holder is certainly gone (a process of
this host that no longer exists, or an earlier attempt of the same run: a requeued Slurm job, recreated pods); it
then reads it back after a
moment, and gives way if another run wrote it meanwhile. Only a resuming run may take over a mirror that holds
another run's checkpoints; a new run is refused there, as it is in an output directory that holds another run.
"""

import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from trl_ext.errors import MirrorError
from trl_ext.mirror.store import RUN_MARKER, Store
from trl_ext.scheduling import ownership

LEASE_SECONDS = 120.0  # a marker not renewed for this long is free
RENEW_SECONDS = 30.0  # how often a training run renews it
SETTLE_SECONDS = 1.0  # between writing the marker and reading it back


@dataclass
class Holder:
    """A run as its marker describes it."""

    run: str = field(default_factory=lambda: uuid.uuid4().hex)
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    job: str | None = field(default_factory=ownership.current_run)  # the orchestrator's run identity, if any
    output_dir: str = ""
    renewed: float = 0.0
    released: bool = False

    @classmethod
    def from_dict(cls, raw: dict) -> "Holder":
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        return cls(**known)

    def describe(self) -> str:
        job = f", {self.job}" if self.job else ""
        return f"run {self.run[:8]} (host {self.host}, pid {self.pid}{job}, output_dir {self.output_dir})"


def _gone(other: Holder, me: Holder, now: float) -> str | None:
    """Why ``other``'s lease is free for ``me`` (None: it may still be writing)."""
    if other.released:
        return "it ended"
    if now - other.renewed > LEASE_SECONDS:
        return f"it was last renewed {now - other.renewed:.0f} s ago"
    if other.job and other.job == me.job:
        return f"it was an earlier attempt of this run ({other.job})"
    if other.host == me.host:
        try:
            os.kill(other.pid, 0)
        except ProcessLookupError:
            return f"its process {other.pid} on this host has ended"
        except PermissionError:
            pass
    return None


def claim(store: Store, me: Holder, resuming: bool, say: Callable[[str], None]) -> None:
    """Take the mirror for this run, or raise.

    Args:
        store: the mirror.
        me: this run.
        resuming: whether this run continues a run (``resume_from_checkpoint``, a requeued job): only then may it
            take over a mirror that holds another run's checkpoints.
        say: prints one line (a wait for a lease to expire).

    Raises:
        MirrorError: another run writes there, or it holds another run's checkpoints and this run does not resume.
    """
    deadline = time.time() + LEASE_SECONDS + 5
    while True:
        raw = store.read_json(RUN_MARKER)
        other = Holder.from_dict(raw) if raw else None
        if other is not None and other.run != me.run:
            same_job = bool(other.job) and other.job == me.job  # a restarted run is the same run
            if not resuming and not same_job:
                raise MirrorError(f"checkpoint_mirror {store.shown} belongs to another {other.describe()}: resume "
                                  "that run (resume_from_checkpoint=True), or choose another checkpoint_mirror")
            why = _gone(other, me, time.time())
            if why is None:
                if time.time() > deadline:
                    raise MirrorError(f"checkpoint_mirror {store.shown} is being written by another "
                                      f"{other.describe()}: stop that run, or choose another checkpoint_mirror")
                say(f"checkpoint_mirror {store.shown} is held by {other.describe()}, renewed "
                    f"{time.time() - other.renewed:.0f} s ago; waiting up to {LEASE_SECONDS:.0f} s for it to expire")
                time.sleep(min(10.0, max(1.0, LEASE_SECONDS - (time.time() - other.renewed))))
                continue
            say(f"checkpoint_mirror {store.shown}: taking it over from {other.describe()}: {why}")
        elif other is None and not resuming and store.complete():
            raise MirrorError(f"checkpoint_mirror {store.shown} already holds checkpoints of another run: resume "
                              "that run (resume_from_checkpoint=True), or choose another checkpoint_mirror")
        me.renewed, me.released = time.time(), False
        store.write_json(RUN_MARKER, asdict(me))
        time.sleep(SETTLE_SECONDS)
        if holds(store, me):
            return
        # another run wrote its marker at the same moment: the one whose marker stayed goes on


def holds(store: Store, me: Holder) -> bool:
    """Whether the marker is still this run's."""
    raw = store.read_json(RUN_MARKER)
    return bool(raw) and raw.get("run") == me.run


def renew(store: Store, me: Holder) -> bool:
    """Renew this run's lease; False if another run holds the mirror now (this run must stop writing)."""
    if not holds(store, me):
        return False
    me.renewed = time.time()
    store.write_json(RUN_MARKER, asdict(me))
    return True


def release(store: Store, me: Holder) -> None:
    """The run ended: its lease is free at once (a resuming run need not wait for it to expire)."""
    if holds(store, me):
        me.released = True
        store.write_json(RUN_MARKER, asdict(me))
