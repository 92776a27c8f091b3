"""The uploads of a mirror, on a thread of their own: training only hard-links a committed checkpoint's files into the
outbox (``outbox``: ``.trl_ext-mirror/checkpoint-N`` in the output directory) and queues it; the thread uploads its
files in parallel (multipart for large ones), then writes the manifest, last, and applies the remote retention.

The store's client retries each request (S3: botocore's standard mode, ``store.S3_ATTEMPTS`` attempts with backoff)
and tells the uploader of each failed attempt, so that the log says at once that the store does not answer. A
checkpoint whose upload still fails that way (``store.is_store_failure``: connection errors, timeouts, 5xx,
throttling) stays first in the queue and is sent again ``RESEND_SECONDS`` later (the files it already sent are kept),
for as long as training runs: an outage of any length is caught up. Any other exception is an error of our own, which
sending again would only repeat: it is said once, with its type and first line, nothing more is uploaded, and the
training side raises it at its next step (``raise_if_broken``).

The outbox keeps a queued checkpoint whole while local rotation (``save_total_limit``) removes its folder, and
survives a crash: the next run on the machine finishes the upload (``outbox.pending``). The thread runs while there is
work and ends when there is none. It is a daemon: what a process that exits still has to upload is finished by
``finish_at_exit``, which runs before the interpreter joins its threads and shuts down the thread pools the uploads
use (``process.before_exit``), for at most ``exit_grace`` seconds (``mirror_exit_grace_period``); past them, or once
the store has not answered for ``STALL_SECONDS`` after training ended, the process exits all the same, saying in one
line what stayed only local, kept in the outbox. A SIGTERM meanwhile (a scheduler ending the job, or torchrun ending
this rank because another rank failed) is held back for at most ``signal_grace`` more seconds
(``mirror_grace_period``), then delivered as it came (``HeldSignal``). ``abandon`` stops at once (the grace period of a
preempted run ran out).
"""

import contextlib
import shutil
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from trl_ext.errors import ABANDONED, STALLED, MirrorError, TrlExtError
from trl_ext.files import manifest
from trl_ext.mirror import lease
from trl_ext.mirror.outbox import Upload
from trl_ext.mirror.store import Store, first_line, is_store_failure
from trl_ext.process.clean_exit import before_exit
from trl_ext.settings.trainer_options import MirrorOptions

FILES_IN_PARALLEL = 4
RESEND_SECONDS = 10.0  # a checkpoint the store failed, after its client's own retries, is sent again this much later
STALL_SECONDS = 300.0  # once training has ended: give up after the store has not answered for this long
WARN_EVERY_SECONDS = 60.0
EXIT_JOIN_SECONDS = 5.0  # at exit, once given up: the longest wait for the request in flight to end


def in_parallel(calls: list[Callable[[], None]], workers: int) -> None:
    """Run ``calls`` on up to ``workers`` daemon threads of our own, and wait for them; the first exception is raised
    once they have stopped (no call starts after one failed).

    Own threads rather than a ``ThreadPoolExecutor``: the interpreter joins a pool's threads at exit, without bound (a
    request to a store that stopped answering would keep a finished process alive), and its pools refuse new work
    once it exits.

    Args:
        calls: what to run, each without arguments.
        workers: the most threads at once.
    """
    todo, failures, lock = deque(calls), [], threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not todo or failures:
                    return
                call = todo.popleft()
            try:
                call()
            except BaseException as exc:  # noqa: BLE001 - raised on the calling thread below
                with lock:
                    failures.append(exc)

    threads = [threading.Thread(target=work, name="trl_ext-mirror-file", daemon=True)
               for _ in range(min(workers, len(calls)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]


class Outage:
    """Since when the store has not answered, and the last error it gave."""

    def __init__(self):
        self.since: float | None = None
        self.error = ""
        self.lock = threading.Lock()

    def failed(self, exc: BaseException) -> None:
        with self.lock:
            self.since = self.since or time.monotonic()
            self.error = first_line(exc)

    def answered(self) -> float | None:
        """The store answered; returns how long it had not (None if it had)."""
        with self.lock:
            since, self.since = self.since, None
        return None if since is None else time.monotonic() - since

    def seconds(self) -> float:
        since = self.since
        return 0.0 if since is None else time.monotonic() - since


class HeldSignal:
    """While the process exits and its uploads finish: a SIGTERM is recorded, not acted on, and delivered as it came
    once they are done (the process then ends by it, as it would have), at most ``grace`` seconds after it came.

    Why: under torchrun, a rank that fails makes the launcher send SIGTERM to the others, and SIGKILL 30 s later; rank
    0, finishing the final model's upload at exit, would die at once and the model would never reach the mirror. A
    scheduler's SIGTERM gets ``mirror_grace_period``, as during training. Only on the main thread, and only where
    SIGTERM's handler is Python's to change (not ignored).

    Args:
        grace: the most seconds the uploads go on after the signal.
    """

    def __init__(self, grace: float):
        self.grace, self.since, self._previous = grace, None, None

    def __enter__(self) -> "HeldSignal":
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGTERM)
            if previous is not None and previous is not signal.SIG_IGN:
                self._previous = previous
                signal.signal(signal.SIGTERM, self._record)
        return self

    def _record(self, signum, frame) -> None:
        self.since = self.since or time.monotonic()

    def deadline(self, deadline: float) -> float:
        """``deadline`` (a ``time.monotonic`` reading), brought forward to ``grace`` seconds after a signal."""
        return deadline if self.since is None else min(deadline, self.since + self.grace)

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            if self.since is not None:
                signal.raise_signal(signal.SIGTERM)


class Uploader:
    """Uploads queued checkpoints and models, one at a time, each file in parallel; see the module's docstring.

    Args:
        store: the mirror.
        holder: this run's lease (renewed by ``renew_if_due``, checked before every manifest).
        outbox_root: ``<output_dir>/.trl_ext-mirror``.
        keep: how many complete checkpoints the mirror keeps (``save_total_limit``; None: all).
        protected: the checkpoint steps retention never deletes (the best model's), asked at each retention.
        say: prints one line.
        exit_grace: at exit, the longest wait in seconds for the uploads still queued (``finish_at_exit``).
        signal_grace: at exit, the longest wait in seconds after a SIGTERM (``mirror_grace_period``).
    """

    def __init__(self, store: Store, holder: lease.Holder, outbox_root: Path, keep: int | None,
                 protected: Callable[[], set[int]], say: Callable[[str], None],
                 exit_grace: float = MirrorOptions.mirror_exit_grace_period,
                 signal_grace: float = MirrorOptions.mirror_grace_period):
        self.store, self.holder, self.outbox_root, self.keep = store, holder, outbox_root, keep
        self.protected, self.say, self.exit_grace, self.signal_grace = protected, say, exit_grace, signal_grace
        self._queue: deque[Upload] = deque()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._current: Upload | None = None
        self._current_bytes = [0, 0]  # uploaded, total of the job in flight
        self._cancel = threading.Event()
        self._renew_due = time.monotonic() + lease.RENEW_SECONDS
        self._lost = False  # another run took the mirror over: nothing more is written
        self._warned = self._warned_outage = -WARN_EVERY_SECONDS
        self.closing = False  # training has ended: give up after STALL_SECONDS without an answer
        self.outage = Outage()
        self.local_step: int | None = None  # the newest checkpoint queued
        self.remote_step: int | None = None  # the newest checkpoint complete in the mirror
        self.completed: list[tuple[str, float]] = []  # (rel, seconds) of each finished upload, for tests and benches
        self.failed: list[str] = []  # what could not be uploaded (only local), one line each
        self.error: BaseException | None = None  # an error of our own that stopped the uploads (never sent again)
        self._raised = False
        store.on_retry(self._store_failed)
        before_exit(self.finish_at_exit)

    # ------------------------------------------------------------------------------------------- training side
    def submit(self, job: Upload) -> None:
        """Queue ``job`` (training goes on at once); queued checkpoints that retention would delete right after they
        completed are dropped."""
        with self._lock:
            if self.error is not None:  # stopped on an error of our own: kept in the outbox for a later run
                self.failed.append(job.name)
                return
            self._queue.append(job)
            if job.step is not None:
                self.local_step = max(job.step, self.local_step or 0)
            if self.keep:
                checkpoints = [j for j in self._queue if j.step is not None]
                for old in checkpoints[:-self.keep] if len(checkpoints) > self.keep else []:
                    self._queue.remove(old)
                    shutil.rmtree(old.folder, ignore_errors=True)
            self._start()
        self._say_lag()

    def renew_if_due(self) -> None:
        """Renew the lease once every ``RENEW_SECONDS`` (queued as work: never blocks training)."""
        if time.monotonic() >= self._renew_due and not self._lost:
            with self._lock:
                self._start()

    def raise_if_broken(self) -> None:
        """On the training side: raise the error of our own that stopped the uploads (once).

        Raises:
            MirrorError: the uploads stopped on an error that is not the store's.
        """
        if self.error is not None and not self._raised:
            self._raised = True
            raise MirrorError(f"checkpoint_mirror {self.store.shown}: the uploads stopped on an error of trl_ext's "
                              f"own, not the store's ({first_line(self.error)}); every checkpoint is in output_dir, "
                              f"and those not uploaded are kept in {self.outbox_root} for the next run")

    def _start(self) -> None:
        if self.error is not None:
            return
        if self._thread is None or not self._thread.is_alive():
            self._cancel.clear()
            # a daemon: finish_at_exit waits for the uploads, within its bound, before the interpreter ends
            self._thread = threading.Thread(target=self._run, name="trl_ext-mirror", daemon=True)
            self._thread.start()

    def status(self) -> dict[str, float]:
        """How far the mirror is behind the output directory: checkpoints and steps not complete there yet."""
        with self._lock:
            behind = sum(j.step is not None for j in self._queue) + int(
                self._current is not None and self._current.step is not None)
        steps = (self.local_step or 0) - (self.remote_step or 0) if behind else 0
        return {"behind_checkpoints": behind, "behind_steps": max(steps, 0),
                "store_silent_seconds": round(self.outage.seconds(), 1)}

    def idle(self) -> bool:
        with self._lock:
            return not self._queue and self._current is None

    def wait(self, timeout: float | None) -> bool:
        """Wait until every queued upload is done (or given up); True if so within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._queue or self._current is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(timeout=min(left, 1.0) if left is not None else 1.0)
        return True

    def abandon(self, join: float = 30.0) -> list[str]:
        """Stop now: the upload in flight is discarded (the previous complete checkpoint stays the mirror's newest),
        and what was queued stays in the outbox for a later run.

        Args:
            join: the longest wait, in seconds, for the request in flight to end (the thread is a daemon).

        Returns:
            The names left only local.
        """
        with self._lock:
            left = [j.name for j in ([self._current] if self._current else []) + list(self._queue)]
            self._queue.clear()
        self._cancel.set()
        if self._thread is not None:
            self._thread.join(timeout=join)
        return left

    def finish_at_exit(self) -> None:
        """The process exits (``process.before_exit``: before the interpreter joins its threads and shuts its thread
        pools): the uploads still queued are finished within ``exit_grace`` seconds, and the lease released; past
        them (or once the store has not answered for ``STALL_SECONDS``) what is left stays in the outbox, said in one
        line, and the process exits all the same."""
        if self._lost:
            return
        with self._lock:
            left = [j.name for j in ([self._current] if self._current else []) + list(self._queue)]
        self.closing = True
        if left:
            self.say(f"checkpoint_mirror: finishing the upload of {', '.join(left)} to {self.store.shown} before this "
                     f"process exits (at most {self.exit_grace:.0f} s: mirror_exit_grace_period)")
        with self._lock:
            self._start()  # with nothing left, the thread releases the lease and ends
        thread = self._thread
        deadline = time.monotonic() + self.exit_grace
        with HeldSignal(self.signal_grace) as held:  # a SIGTERM now is delivered once this block ends
            said = False
            while not (done := self.wait(max(0.0, min(held.deadline(deadline) - time.monotonic(), 0.5)))):
                if held.since is not None and not said:
                    said = True
                    self.say(f"checkpoint_mirror: SIGTERM while this process exits: the uploads get at most "
                             f"{self.signal_grace:.0f} s more (mirror_grace_period), then it ends")
                if time.monotonic() >= held.deadline(deadline):
                    break
            if done:
                if thread is not None:
                    thread.join(EXIT_JOIN_SECONDS)
                if self.failed:
                    self.say(f"checkpoint_mirror: only local at exit: {', '.join(self.failed)} (kept in "
                             f"{self.outbox_root}; the next run with this output_dir uploads them)")
                return
            left = self.abandon(join=EXIT_JOIN_SECONDS)
            silent = (f"; the store has not answered for {self.outage.seconds():.0f} s ({self.outage.error})"
                      if self.outage.since is not None else "")
            ran_out = (f"{self.signal_grace:.0f} s mirror_grace_period after SIGTERM" if held.deadline(deadline) <
                       deadline else f"{self.exit_grace:.0f} s mirror_exit_grace_period")
            self.say(f"checkpoint_mirror: exiting with {', '.join(left + self.failed)} only local: the {ran_out} ran "
                     f"out{silent}. They are kept in {self.outbox_root}: the next run with this output_dir uploads "
                     "them")

    # --------------------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        while True:
            with self._lock:
                job = self._queue.popleft() if self._queue and not self._lost else None
                self._current = job
                done = job is None and (time.monotonic() < self._renew_due or self.closing)
            if done and self.closing and not self._lost and not self._cancel.is_set():
                with contextlib.suppress(Exception):  # an expired lease frees the mirror too
                    lease.release(self.store, self.holder)  # a resuming run need not wait for it to expire
            if done:
                with self._lock:
                    if self._queue:  # queued meanwhile
                        continue
                    self._thread = None if self._thread is threading.current_thread() else self._thread
                    self._lock.notify_all()
                    return
            try:
                if time.monotonic() >= self._renew_due:
                    self._renew()
                if job is not None:
                    self._upload(job)
            except MirrorError as exc:
                if exc.kind == STALLED:
                    self._give_up(job)
                elif exc.kind != ABANDONED and job is not None:
                    self.failed.append(f"{job.name}: {exc}")
                    self.say(f"mirror {self.store.url_of(job.rel)}: the upload failed ({exc}); it stays only local: "
                             f"{job.folder}")
            except Exception as exc:  # noqa: BLE001 - sorted below: the store's failure, or an error of our own
                if not is_store_failure(exc):
                    self._broken(job, exc)
                elif job is not None:  # the store, after its client's own retries (said): sent again later
                    self._resend(job)
            finally:
                with self._lock:
                    self._current = None
                    self._lock.notify_all()

    def _renew(self) -> None:
        self._renew_due = time.monotonic() + lease.RENEW_SECONDS
        if not self._call(lambda: lease.renew(self.store, self.holder)):
            self._lose()

    def _lose(self) -> None:
        self._lost = True
        other = lease.newest(self.store) or lease.Holder()
        self.say(f"mirror {self.store.shown}: another {other.describe()} took it over; this run uploads nothing more "
                 "(its checkpoints stay local)")

    def _give_up(self, job: Upload | None) -> None:
        with self._lock:
            left = [j.name for j in ([job] if job else []) + list(self._queue)]
            self._queue.clear()
        self.failed += left
        self.say(f"mirror {self.store.shown}: the store has not answered for {self.outage.seconds():.0f} s since "
                 f"training ended ({self.outage.error}); only local: {', '.join(left)} (kept in "
                 f"{self.outbox_root}; the next run here finishes the upload)")

    def _broken(self, job: Upload | None, exc: BaseException) -> None:
        """An error of our own (not the store's): said once, with its type and first line; nothing more is uploaded
        (it would only repeat), what is left stays in the outbox for a later run, and training raises it at its next
        step."""
        with self._lock:
            left = [j.name for j in ([job] if job else []) + list(self._queue)]
            self._queue.clear()
            self.error = exc
        self.failed += left
        self.say(f"checkpoint_mirror {self.store.shown}: the uploads stopped on an error of trl_ext's own, not the "
                 f"store's ({first_line(exc)}); only local: {', '.join(left) or 'nothing yet'} (kept in "
                 f"{self.outbox_root}; the next run with this output_dir uploads them). Please report it")

    def _resend(self, job: Upload) -> None:
        """The store failed ``job`` after its client's own retries: it goes first in the queue again, sent
        ``RESEND_SECONDS`` later (sooner when stopped), or, once training has ended and the store has been silent
        for ``STALL_SECONDS``, is given up on."""
        if self.closing and self.outage.seconds() > STALL_SECONDS:
            self._give_up(job)
            return
        with self._lock:
            self._queue.appendleft(job)
            self._current = None
        self._cancel.wait(RESEND_SECONDS)

    def _store_failed(self, exc: BaseException) -> None:
        """A request to the store failed (called between its client's retries, and after them): the outage is said,
        once a minute. Ends the retries (by raising) of a stopped upload, and once training has ended and the store
        has been silent for ``STALL_SECONDS``."""
        self.outage.failed(exc)
        if self._cancel.is_set():
            raise MirrorError("the upload was stopped", kind=ABANDONED)
        if self.closing and self.outage.seconds() > STALL_SECONDS:
            raise MirrorError(f"the store did not answer for {STALL_SECONDS:.0f} s", kind=STALLED)
        self._say_lag(force_outage=True)

    def _call(self, call):
        """``call()``, once (the store's client retries it); a failure is said, and raised."""
        if self._cancel.is_set():
            raise MirrorError("the upload was stopped", kind=ABANDONED)
        try:
            result = call()
        except TrlExtError:  # ours: a local file, a stop on purpose
            raise
        except Exception as exc:  # noqa: BLE001 - the store's own kinds count as an outage; ours are raised as they are
            if is_store_failure(exc):
                self._store_failed(exc)
            raise
        silent = self.outage.answered()
        if silent is not None:
            self.say(f"mirror {self.store.shown}: the store answers again after {silent:.0f} s; catching up "
                     f"({self._lag_text()})")
        return result

    def _upload(self, job: Upload) -> None:
        started = time.monotonic()
        files = job.files()
        folder = Path(job.folder)
        sizes = {name: (folder / name).stat().st_size for name in files}
        self._current_bytes = [sum(size for size, _ in job.sent.values()), sum(sizes.values())]
        # a manifest there describes an earlier upload of this name: it stops counting before any file changes
        self._call(lambda: self.store.delete(f"{job.rel}/{manifest.NAME}" if job.rel else manifest.NAME,
                                             recursive=False))

        def one(name: str) -> None:
            rel = f"{job.rel}/{name}" if job.rel else name
            size, digest = self._call(lambda: self.store.upload(folder / name, rel, self._cancel.is_set))
            with self._lock:  # the files upload in parallel
                job.sent[name] = (size, digest)
                self._current_bytes[0] += size

        # files of an earlier upload of this checkpoint that this one does not have: listed while these upload
        found: list[str] = []
        listing = [lambda: found.extend(self._call(lambda: self.store.files(job.rel)))] if job.step is not None else []
        todo = sorted((n for n in files if n not in job.sent), key=lambda n: -sizes[n])  # sent before an outage
        in_parallel(listing + [lambda n=name: one(n) for name in todo], FILES_IN_PARALLEL)
        extra = set(found) - set(files) - {manifest.NAME}
        for name in extra:
            self._call(lambda n=name: self.store.delete(f"{job.rel}/{n}", recursive=False))
        done = manifest.Manifest(step=job.step, run=self.holder.run)
        for name in files:
            done.add(name, *job.sent[name])
        if not self._call(lambda: lease.holds(self.store, self.holder)):
            self._lose()
            return
        self._call(lambda: self.store.write_manifest(job.rel, done))  # last: now it counts
        seconds = time.monotonic() - started
        self.completed.append((job.rel, seconds))
        if job.step is not None:
            self.remote_step = max(job.step, self.remote_step or 0)
        if not self._cancel.is_set():  # abandoned meanwhile: the exit's line names it as kept in the outbox: it stays
            shutil.rmtree(job.folder, ignore_errors=True)
        self.say(f"mirror: {job.name} complete at {self.store.url_of(job.rel)} ({len(files)} files, "
                 f"{done.total_bytes / 2**20:.1f} MiB in {seconds:.1f} s)")
        if job.step is not None:
            self._retention()

    def _retention(self) -> None:
        """Keep the newest ``keep`` complete checkpoints (and the protected ones); delete the others, manifest first,
        and any incomplete folder older than the newest complete checkpoint (an abandoned upload)."""
        found = self._call(self.store.checkpoints)
        complete = sorted((s for s, done in found.items() if done), reverse=True)
        if not complete:
            return
        doomed = [s for s in complete[self.keep:] if s not in self.protected()] if self.keep else []
        doomed += [s for s, done in found.items() if not done and s < complete[0]]
        for step in doomed:
            rel = f"checkpoint-{step}"
            self._call(lambda r=rel: self.store.delete(f"{r}/{manifest.NAME}", recursive=False))
            self._call(lambda r=rel: self.store.delete(r))

    def _lag_text(self) -> str:
        status = self.status()
        return (f"{status['behind_checkpoints']} checkpoint(s), {status['behind_steps']} step(s) behind the output "
                "directory")

    def _say_lag(self, force_outage: bool = False) -> None:
        """One line, at most once a minute, while the mirror is behind by more than the checkpoint in flight or the
        store does not answer."""
        status = self.status()
        if not force_outage and status["behind_checkpoints"] < 2:
            return
        now = time.monotonic()
        last = self._warned_outage if force_outage else self._warned
        if now - last < WARN_EVERY_SECONDS:
            return
        self._warned = now
        if force_outage:  # an outage is said once a minute, whatever lag lines came before it
            self._warned_outage = now
        done, total = self._current_bytes
        current = self._current
        uploading = (f"; uploading {current.name}: {done / 2**20:.0f} of {total / 2**20:.0f} MiB"
                     if current is not None else "")
        silent = (f"; the store has not answered for {self.outage.seconds():.0f} s ({self.outage.error}), retrying "
                  "with backoff" if self.outage.since is not None else "")
        self.say(f"mirror {self.store.shown} is {self._lag_text()}{uploading}{silent}; training goes on")

    def close(self) -> None:
        """Training has ended: from now on, a store silent for ``STALL_SECONDS`` ends the uploads."""
        self.closing = True
        with contextlib.suppress(Exception):
            self._say_lag()
        with self._lock:
            self._start()  # with nothing left, the thread releases the lease and ends
