"""Which run writes to a mirror: a lease that one run holds at a time, so that two runs never write to the same prefix.

The lease is a folder of numbered markers at the mirror's top (``trl_ext-mirror-run/000000000001.json``, ...); the
newest one names the run that holds it, renewed while it trains. A run takes the lease by creating the next number
with the store's atomic create-if-absent (S3's conditional write ``If-None-Match: *``, GCS's ``ifGenerationMatch=0``,
Azure's ``If-None-Match``, a hard link on a file system: ``Store.create``): of two runs that start together, exactly
one creates it, and the other sees it taken. A run may take it when no marker exists, or when the newest one was
released, expired (not renewed for ``LEASE_SECONDS``) or written by a run certainly gone (a process of this host that
no longer exists, or an earlier attempt of the same run: a requeued Slurm job, recreated pods). Only a resuming run
may take over a mirror that holds another run's checkpoints; a new run is refused there, as it is in an output
directory that holds another run.

A store without an atomic create (``memory://``, ``hf://``, an S3-compatible server that ignores the condition) is
said at start: there the marker is written, then read back after ``SETTLE_SECONDS``, and two runs that start at the
same moment could both believe they hold it.
"""

import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from trl_ext.errors import MirrorError
from trl_ext.mirror.store import Store
from trl_ext.placement import ownership

MARKERS = "trl_ext-mirror-run"  # at the mirror's top: the lease's numbered markers
LEASE_SECONDS = 120.0  # a marker not renewed for this long is free
RENEW_SECONDS = 30.0  # how often a training run renews it
SETTLE_SECONDS = 1.0  # without an atomic create: between writing the marker and reading it back


def this_job() -> str | None:
    """What this run shares with its own restarts, recorded as the marker's ``job``: its orchestrator's run identity
    (a Slurm job id, a SkyPilot task, a TrainJob, torchrun's --rdzv-id: ``placement.orchestrators``), or None."""
    return ownership.current_run()


@dataclass
class Holder:
    """A run as its marker describes it; ``number`` is its marker's (0 until it holds the lease)."""

    run: str = field(default_factory=lambda: uuid.uuid4().hex)
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    job: str | None = field(default_factory=this_job)
    output_dir: str = ""
    renewed: float = 0.0
    released: bool = False
    number: int = 0

    @classmethod
    def from_dict(cls, raw: dict) -> "Holder":
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        return cls(**known)

    def same_job(self, job: str | None) -> bool:
        """Whether this holder was an earlier attempt of the run ``job`` (``this_job()``)."""
        return bool(self.job) and self.job == job

    def describe(self) -> str:
        job = f", {self.job}" if self.job else ""
        return f"run {self.run[:8]} (host {self.host}, pid {self.pid}{job}, output_dir {self.output_dir})"


def _marker(number: int) -> str:
    return f"{MARKERS}/{number:012d}.json"


def _encode(holder: Holder) -> bytes:
    return json.dumps(asdict(holder), indent=1).encode()


def _numbers(store: Store) -> list[int]:
    return sorted(int(name[:-5]) for name in store.names(MARKERS) if name.endswith(".json") and name[:-5].isdigit())


def newest(store: Store) -> Holder | None:
    """The holder of the mirror's newest marker (its ``number`` set), or None when there is none.

    Raises:
        MirrorError: the markers kept changing while they were read.
    """
    for _ in range(5):  # a marker deleted between the listing and the read: a newer one was taken meanwhile
        numbers = _numbers(store)
        if not numbers:
            return None
        raw = store.read_json(_marker(numbers[-1]))
        if raw is not None:
            holder = Holder.from_dict(raw)
            holder.number = numbers[-1]
            return holder
    raise MirrorError(f"checkpoint_mirror {store.shown}: its lease ({MARKERS}) kept changing while it was read; "
                      "another run is taking it: try again")


def held_by_this_job(store: Store) -> bool:
    """Whether the mirror's lease was last held by an earlier attempt of this run (a requeued Slurm job, recreated
    pods, a recovered SkyPilot task)."""
    holder = newest(store)
    return holder is not None and holder.same_job(this_job())


def _gone(other: Holder, me: Holder, now: float) -> str | None:
    """Why ``other``'s lease is free for ``me`` (None: it may still be writing)."""
    if other.released:
        return "it ended"
    if other.same_job(me.job):  # first: the surer reason, whatever the time since its last renewal
        return f"it was an earlier attempt of this run ({other.job})"
    if now - other.renewed > LEASE_SECONDS:
        return f"it was last renewed {now - other.renewed:.0f} s ago"
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
        me: this run (its ``number`` is set to its marker's).
        resuming: whether this run continues a run (``resume_from_checkpoint``, a requeued job): only then may it
            take over a mirror that holds another run's checkpoints.
        say: prints one line (a store without an atomic create, a wait for a lease to expire, a takeover).

    Raises:
        MirrorError: another run writes there, or it holds another run's checkpoints and this run does not resume.
    """
    unsafe = store.atomic_create
    if unsafe:
        say(f"checkpoint_mirror {store.shown}: {unsafe}, so two runs that start at the same moment could both take "
            "its lease (docs/cloud.md)")
    deadline = time.time() + LEASE_SECONDS + 5
    while True:
        other = newest(store)
        why = None
        if other is not None and other.run != me.run:
            if not resuming and not other.same_job(me.job):  # a restarted run is the same run
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
        elif other is None and not resuming and store.complete():
            raise MirrorError(f"checkpoint_mirror {store.shown} already holds checkpoints of another run: resume "
                              "that run (resume_from_checkpoint=True), or choose another checkpoint_mirror")
        me.renewed, me.released = time.time(), False
        if other is not None and other.run == me.run:  # taken already (a second claim)
            me.number = other.number
            store.write_json(_marker(me.number), asdict(me))
            return
        me.number = (other.number if other is not None else 0) + 1
        if not store.create(_marker(me.number), _encode(me)):
            continue  # another run took this number first: it holds the lease now
        if unsafe:
            time.sleep(SETTLE_SECONDS)
            if not holds(store, me):
                continue  # another run wrote the same marker at the same moment: the one whose marker stayed goes on
        if why is not None:
            say(f"checkpoint_mirror {store.shown}: took it over from {other.describe()}: {why}")
        with contextlib.suppress(Exception):  # the markers before this one: history nothing reads
            for number in _numbers(store):
                if number < me.number:
                    store.delete(_marker(number), recursive=False)
        return


def holds(store: Store, me: Holder) -> bool:
    """Whether this run holds the lease (the newest marker is its own)."""
    holder = newest(store)
    return holder is not None and holder.run == me.run


def renew(store: Store, me: Holder) -> bool:
    """Renew this run's lease; False if another run holds the mirror now (this run must stop writing)."""
    if not holds(store, me):
        return False
    me.renewed = time.time()
    store.write_json(_marker(me.number), asdict(me))  # its own marker: a later one taken meanwhile stays the newest
    return True


def release(store: Store, me: Holder) -> None:
    """The run ended: its lease is free at once (a resuming run need not wait for it to expire)."""
    if holds(store, me):
        me.released = True
        store.write_json(_marker(me.number), asdict(me))
