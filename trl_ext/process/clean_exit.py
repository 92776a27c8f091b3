"""A clean end for a launched process whose process group is gloo's: the ranks end together (``end_together``), and
the group is destroyed at exit (``destroy_gloo_group_at_exit``). Both work around pytorch#190489: a gloo process can
abort at shutdown ("terminate called without an active exception", SIGABRT) and fail a launch whose work is done."""

import atexit
import functools
import os
import sys
import threading

from trl_ext import patches
from trl_ext.process.hosted import HOSTED
from trl_ext.process.notices import logger
from trl_ext.process.ranks import distributed

_before_exit: list = []  # callbacks run once as the process exits, newest first
_before_exit_hooked = [False]


def before_exit(callback) -> None:
    """Run ``callback()`` once as this process exits, while the interpreter is still whole: before it joins its
    threads and before ``concurrent.futures`` and asyncio refuse new work ("cannot schedule new futures after
    interpreter shutdown"), which background uploads need. ``end_together`` runs these callbacks too. An exception in
    one is said in one line; the others still run.

    Args:
        callback: called with no arguments, on the main thread.
    """
    if not _before_exit_hooked[0]:
        _before_exit_hooked[0] = True
        # threading's own exit hooks run before threads are joined, newest first: registered after concurrent.futures'
        # (imported by now), this one runs before that hook shuts the pools. Private to CPython 3.9+ (patch
        # 'exit-before-thread-pools'); where its guard fails, a plain atexit hook runs later, when pools refuse work.
        register = threading._register_atexit if patches.applies("exit-before-thread-pools") else atexit.register
        try:
            register(_run_before_exit)
        except RuntimeError:  # the interpreter is exiting already
            atexit.register(_run_before_exit)
    _before_exit.append(callback)


def _run_before_exit() -> None:
    while _before_exit:
        callback = _before_exit.pop()
        try:
            callback()
        except Exception as exc:  # noqa: BLE001 - one exit callback's failure must not keep the others from running
            first = (str(exc).strip().splitlines() or [""])[0]
            logger.warning(f"[trl_ext] at exit: {type(exc).__name__}: {first}")


def _destroy_gloo_group() -> None:
    import torch.distributed as dist

    if distributed() and dist.get_backend() == "gloo":
        dist.destroy_process_group()


def end_together() -> None:
    """The last step of a launched script, on every rank: every process waits for the others; then the process group
    is destroyed, and on gloo (CPU) the process ends as the interpreter would, without its teardown (``exit_now``).
    Outside a launch it does nothing; in a rank whose process another framework hosts (``HOSTED``: a Ray Train worker)
    it only waits.

    A gloo process can abort at shutdown ("terminate called without an active exception", SIGABRT; pytorch#190489)
    and fail a launch whose work is done: when a rank leaves while another still works (rank 0 checking the saved
    model in a subprocess), hence the barrier; and in the interpreter's teardown itself, hence none.
    """
    import torch.distributed as dist

    if not distributed():
        return
    dist.barrier()
    if os.environ.get(HOSTED):  # the host (Ray Train) destroys the group and ends the process
        return
    if dist.get_backend() != "gloo":
        dist.destroy_process_group()
        return
    exit_now()


def exit_now() -> None:
    """End this process with code 0 as the interpreter ends it, but without tearing the interpreter down
    (pytorch#190489): threading's exit hooks (``before_exit``'s callbacks first, then concurrent.futures' pools told to
    stop), every non-daemon thread joined, the gloo group destroyed, atexit's callbacks run (logging's flush, trackers'
    finish), the streams flushed, then ``os._exit(0)``.

    The hooks come before the joins, as in the interpreter: an idle ThreadPoolExecutor's workers are non-daemon
    threads that end only once concurrent.futures' hook tells them to (a colocated vLLM leaves such pools). Joined
    first, they never ended, and a finished run hung. Off the main thread, or where CPython lacks the private functions
    this needs (the guards of patches 'exit-threads-now' and 'exit-callbacks-now' fail), it returns, and the process
    exits as the interpreter does (the group destroyed by an atexit hook).
    """
    if not (patches.applies("exit-threads-now") and patches.applies("exit-callbacks-now")) \
            or threading.current_thread() is not threading.main_thread():
        destroy_gloo_group_at_exit()
        return
    threading._shutdown()  # the interpreter's first exit step: threading's hooks, then the non-daemon threads joined
    _destroy_gloo_group()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@functools.cache
def destroy_gloo_group_at_exit() -> None:
    """Destroy the default process group at exit when it is gloo's (registered once per process), as PyTorch asks of
    every program that creates one.

    A process that exits with a live gloo group can abort at interpreter shutdown ("terminate called without an active
    exception", SIGABRT; pytorch#190489; torch has no exit hook of its own, pytorch PR#179291). Destroying the group
    first makes it rarer, not impossible (docs/limits.md). The hook runs while the interpreter is whole; a group
    already destroyed is left alone.
    """
    atexit.register(_destroy_gloo_group)
