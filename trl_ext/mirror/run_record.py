"""The run's record (``placement.ownership``: its failed attempts in a row, the newest checkpoint it had then) kept
beside its mirrored checkpoints too, at the mirror's top (``trl_ext-run-record.json``): a run recovered onto an empty
disk (a SkyPilot task on new VMs, a pod on a new node without its volume) keeps its count of failed attempts
(``placement.failure_limit``) as it keeps its checkpoints.
"""

import os
from pathlib import Path

from trl_ext.mirror.store import Store, first_line
from trl_ext.placement import failure_limit, ownership
from trl_ext.process import notice

NAME = "trl_ext-run-record.json"


def restore(store: Store, output_dir: str | Path) -> None:
    """Where the mirror holds this run's record and the output directory holds none, or one this process has just
    made (``ownership.claimed_here``: a fresh disk), make the mirror's the output directory's.

    Args:
        store: the run's mirror (global rank 0).
        output_dir: the run's output directory.
    """
    mirrored = store.read_json(NAME) or {}
    run = ownership.current_run()
    if not run or mirrored.get("run") != run:
        return
    if ownership.record(output_dir) and os.path.abspath(output_dir) not in ownership.claimed_here:
        return  # the disk kept the run's own record (or holds another run's: refused elsewhere)
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    ownership.replace_record(output_dir, mirrored)


def save(store: Store, output_dir: str | Path) -> None:
    """Copy the output directory's record of this run to the mirror (nothing when it holds no record of this run).

    Args:
        store: the run's mirror (global rank 0).
        output_dir: the run's output directory.
    """
    local = ownership.record(output_dir)
    if local and local.get("run") == ownership.current_run():
        store.write_json(NAME, local)


def newest_complete(store: Store) -> int:
    """The step of the mirror's newest complete checkpoint (0: none)."""
    return next(iter(store.complete()), 0)


def begin_attempt(store: Store | None, output_dir: str | Path, newest: int = 0) -> None:
    """``failure_limit.begin`` with the run's mirror, if it has one: its record restored first where the disk lacks it,
    its newest complete checkpoint counted as progress, and the record copied back whatever the verdict.

    Args:
        store: the run's mirror (None without one); call this on global rank 0.
        output_dir: the run's output directory.
        newest: the step of the run's newest checkpoint kept elsewhere (its memory tier's on this machine), counted as
            progress too (0: none).

    A store that fails here (after its client's own retries) costs the copy, not the run: one line says the count is
    kept on this disk only, and training starts.

    Raises:
        failure_limit.GaveUp: the run failed too often in a row without a new checkpoint.
    """
    if store is None:
        failure_limit.begin(output_dir, newest=newest)
        return

    def read() -> int:
        restore(store, output_dir)
        return newest_complete(store)

    mirrored = _or_said(read, 0, "read")
    try:
        failure_limit.begin(output_dir, newest=max(newest, mirrored))
    finally:
        _or_said(lambda: save(store, output_dir), None, "write")


def _or_said(call, otherwise, what: str):
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the mirror's own uploads report its failures; this copy is a convenience
        notice(f"checkpoint_mirror: could not {what} the run's record ({NAME}) there ({first_line(exc)}): its count of "
               "failed attempts is kept in the output directory only")
        return otherwise
