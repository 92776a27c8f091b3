"""A thread of its own that runs what it is given, one call after another, started once and reused, and ended by
``close`` (at the end of ``train()``, and at exit).

Started once rather than per checkpoint: ``Thread.start`` returns only once the new thread has run, and on a busy CPU
(the other ranks training, the checkpoint's copies already running) that wait held the training thread 40-150 ms
(ZeRO-3, 2 processes on 2 cores: most of a background checkpoint's hold). Not ``concurrent.futures.ThreadPoolExecutor``:
its threads are joined at interpreter exit without a time limit, so a checkpoint stuck in a collective with a rank that
died would hang the exit. This thread is a daemon for the same reason; ``close`` ends it once its calls are done,
waiting at most the time it is given.
"""

import atexit
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

EXIT_TIMEOUT_S = 60.0  # at exit, how long the calls still queued may take before the process ends without them
_STOP = object()  # queued by close: the thread ends once the calls before it are done


class CallThread:
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
            self._thread = threading.Thread(target=self._loop, args=(self._calls,), name=self.name, daemon=True)
            self._thread.start()
            atexit.register(self._close_at_exit)

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

    def close(self, timeout: float | None = None) -> bool:
        """End the thread once the calls submitted before are done; a later ``submit`` starts a new one.

        Args:
            timeout: the longest wait, in seconds (None: as long as they take).

        Returns:
            Whether the thread has ended (False: a call still runs; the daemon thread is left to it).
        """
        thread = self._thread
        if thread is None:
            return True
        atexit.unregister(self._close_at_exit)
        if thread.is_alive():
            self._calls.put(_STOP)
            self._calls = queue.SimpleQueue()  # a later start's thread gets a queue of its own
            thread.join(timeout)
        self._thread = None
        return not thread.is_alive()

    def _close_at_exit(self) -> None:
        self.close(EXIT_TIMEOUT_S)

    def _loop(self, calls: queue.SimpleQueue) -> None:
        while (item := calls.get()) is not _STOP:
            future, call, args = item
            future.set_running_or_notify_cancel()
            try:
                future.set_result(call(*args))
            except BaseException as exc:  # noqa: BLE001 - kept in the future, and reported as a thread's would be
                future.set_exception(exc)
                threading.excepthook(threading.ExceptHookArgs((type(exc), exc, exc.__traceback__,
                                                               threading.current_thread())))
