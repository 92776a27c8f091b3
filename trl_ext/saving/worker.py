"""A thread of its own that runs what it is given, one call after another, started once and reused.

Why not a new thread per checkpoint: ``Thread.start`` returns only once the new thread has run, and on a busy CPU (the
other ranks training, this checkpoint's copies already running) that held the training thread 40-150 ms at every
checkpoint (measured: ZeRO-3, 2 processes on 2 cores, most of a background checkpoint's hold). Not
``concurrent.futures.ThreadPoolExecutor``: its threads are joined at interpreter exit, so a save stuck in a collective
with a rank that died would hang the exit; this thread is a daemon, as the per-checkpoint threads were.
"""

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future


class Worker:
    """One daemon thread, started on first use (or by ``start``), running submitted calls in order.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str):
        self.name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread now (once), so that no later ``submit`` waits for it to start."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def submit(self, call: Callable, *args) -> Future:
        """Run ``call(*args)`` on the thread, after what was submitted before.

        Args:
            call: what to run.
            *args: its arguments.

        Returns:
            Its future: its result, or what it raised (also reported as an uncaught thread exception would be).
        """
        future = Future()
        self.start()
        self._calls.put((future, call, args))
        return future

    def _loop(self) -> None:
        while True:
            future, call, args = self._calls.get()
            future.set_running_or_notify_cancel()
            try:
                future.set_result(call(*args))
            except BaseException as exc:  # noqa: BLE001 - kept in the future, and reported as a thread's would be
                future.set_exception(exc)
                threading.excepthook(threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, self._thread)))
