"""This process as the launcher started it: its rank and the world size (readable before any process group), whether
it runs in a process group, every rank-wide decision (rank 0 decides for all: ``decided_on_rank0``; every rank's view:
``gathered``; the largest of every rank's number: ``max_over_ranks``; an error agreed on every rank is
``errors.agree``), the one-line notices trl_ext prints, and a clean exit for its gloo process group."""

import atexit
import functools
import logging
import os
import sys
import threading

logger = logging.getLogger("trl_ext")
# Set where a rank runs inside a process that outlives the run and that its host ends (a Ray Train worker): the run
# ends by returning, never by exiting the process.
HOSTED = "TRL_EXT_HOSTED_RANK"


def env_rank() -> int:
    """This process's global rank as the launcher set it (0 outside a launch); readable before any process group."""
    return int(os.environ.get("RANK", "0"))


def env_world_size() -> int:
    """The number of processes the launcher started (1 outside a launch)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def distributed() -> bool:
    """Whether this process runs in a default process group (a multi-process launch, once it exists)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def decided_on_rank0(decide, group=None):
    """``decide()`` run on rank 0 only, its answer (any picklable object) returned on every rank: for what reads the
    disk, a store or the environment, where ranks could see different things (a file being written, a clock). What it
    raises is raised on every rank, never leaving a rank waiting. A collective when distributed; ``decide()`` alone
    otherwise.

    Args:
        decide: computes the answer; called on rank 0 only.
        group: the process group (default: the default one).

    Returns:
        Rank 0's answer, on every rank.
    """
    if not distributed():
        return decide()
    import torch.distributed as dist

    answer = [None, None]
    if dist.get_rank() == 0:
        try:
            answer = [decide(), None]
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - raised on every rank below (a refusal of bad input too)
            answer = [None, exc]
    dist.broadcast_object_list(answer, src=0, group=group)
    if answer[1] is not None:
        raise answer[1]
    return answer[0]


_speaks = [True]  # whether this machine prints notices (see ``speaks_here``)


def speaks_here(speaks: bool) -> None:
    """Say whether this process prints notices when it is not one of a launch's ranks: a job's launcher on each of
    several machines reads the same input and would say the same; only the first machine's speaks."""
    _speaks[0] = speaks


def gathered(value, group=None) -> list:
    """Every rank's ``value`` (any picklable object), in rank order, on every rank: for what each rank sees on its own
    (a file on its node's disk). A collective when distributed; ``[value]`` otherwise.

    Args:
        value: this rank's value.
        group: the process group (default: the default one).

    Returns:
        The values of all ranks.
    """
    if not distributed():
        return [value]
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def max_over_ranks(values, device=None, group=None):
    """The largest of every rank's number (or of each of a list of numbers), on every rank: one all-reduce, cheap
    enough for every step boundary (a signal that reached only some ranks, the slowest rank's part of a checkpoint).
    ``values`` themselves outside a distributed run.

    Args:
        values: this rank's number, or a list of numbers.
        device: where the collective's tensor lives (default: the backend's, the current CUDA device under NCCL, else
            the CPU).
        group: the process group (default: the default one).

    Returns:
        The maximum over ranks, in the shape given (ints stay ints).
    """
    if not distributed():
        return values
    import torch
    import torch.distributed as dist

    numbers = list(values) if isinstance(values, (list, tuple)) else [values]
    if device is None and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    reduced = torch.tensor([float(v) for v in numbers], dtype=torch.float64, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    out = [type(v)(r) for v, r in zip(numbers, reduced.tolist(), strict=True)]
    return out if isinstance(values, (list, tuple)) else out[0]


def notice(message: str) -> None:
    """One-line notice, printed once per run (rank 0 only when distributed; before the ranks exist, the first
    machine's launcher process)."""
    if env_rank() == 0 and _speaks[0]:
        logger.warning(f"[trl_ext] {message}")


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
        # 'exit-before-thread-pools'); where it is missing, a plain atexit hook runs later, when pools refuse work.
        register = getattr(threading, "_register_atexit", None)
        try:
            (register or atexit.register)(_run_before_exit)
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
    """The last step of a launched script, on every rank: every process waits for the others and the process group is
    destroyed; on gloo (CPU) the process then exits with code 0 as the interpreter would (non-daemon threads joined,
    ``atexit`` callbacks run, streams flushed) but without tearing the interpreter down. Outside a launch it does
    nothing; in a rank whose process another framework hosts (``HOSTED``: a Ray Train worker) it only waits.

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
    _run_before_exit()  # as the interpreter would (background uploads), while this rank's threads can still work
    _destroy_gloo_group()
    for thread in threading.enumerate():  # as the interpreter does before its exit callbacks
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # logging's flush, trackers' finish, ...
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
