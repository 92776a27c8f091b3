"""The driver's side: a run's ranks as one Ray Train worker group, from the connection to the run's outcome.

1. Connect to the cluster within a stated time (``ray.init`` itself waits minutes for an address where nothing
   answers).
2. Size the group (``cluster.size_group``) and wait, for a stated time, until the cluster's nodes have room for its
   minimum (``TRL_EXT_RAY_WAIT_S``, default 300 s; 0 refuses at once); else say what is missing and stop.
3. Run it: ``TorchTrainer`` with
   - ``ScalingConfig``: the group's size (a range is elastic: Ray starts it with what the cluster has, at least the
     minimum, and after a loss goes on with fewer); CPU workers spread across the nodes, GPU workers packed;
   - ``RunConfig``: the run's output directory as Ray's storage for the run (``storage_path`` its parent, ``name``
     its name), so that each committed checkpoint is registered with Ray where it is (``reporting``); Ray keeps its
     own small files there (``checkpoint_manager_snapshot.json``); the workers' runtime environment carries the
     standby processes' setup hook (``standby``);
   - a lost worker or node costs a restart of the group, bounded by the run's own rule (``failure_limit``): after
     ``TRL_EXT_MAX_FAILURES`` (default 3; the former ``TRL_EXT_RAY_MAX_FAILURES`` is still read) lost groups in a
     row without a new committed checkpoint, the run gives up (``controller.Verdict``; Ray's own ``max_failures``,
     which counts every restart even after new checkpoints, is off); an error of the run's own is never retried; a
     group that cannot start waits at most the stated time too.
4. A group that stopped to grow (``growth``) is started again, larger; any other ending is the run's: its ``Result``,
   or one line that says why it failed.

Each restarted group resumes from the run's newest committed checkpoint by itself, at the number of workers it got,
with the same global batch (``resuming``): the run's output directory is marked as the run's (``placement.ownership``)
before the first group starts.
"""

import math
import os
import socket
import sys
import time

from trl_ext.errors import GAVE_UP, RunFailed
from trl_ext.launching.ray import cluster, failures
from trl_ext.launching.ray.worker import GROW, Task
from trl_ext.placement import failure_limit, ownership
from trl_ext.placement.outcome import ERROR
from trl_ext.settings import environment

WAIT_ENV = environment.RAY_WAIT.name  # for room, and for a group that cannot start
CONNECT_SECONDS = 30.0  # for an address where nothing answers
START_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
START_SECONDS = 30.0  # Ray Train's wait for a group's workers to start, before it tries again (its default: 60 s)
NEVER = 1e9  # Ray Train's own resize of a running elastic group: off (it would not save first; ``growth`` does)


def connect(address: str | None, seconds: float = CONNECT_SECONDS) -> None:
    """``ray.init`` to ``address`` (None: ``RAY_ADDRESS``, else the cluster started on this machine), or a one-line
    error within ``seconds`` (``ray.init`` waits minutes at an address where nothing answers: the address is tried
    first).

    Raises:
        UsageError: no Ray cluster answers at the address.
    """
    # Ray folds lines from different workers that differ only in words with digits into one "[repeated Nx across
    # cluster]", seconds later: "Ray: rank 0 of 4 ..., restart 2" would be folded into restart 1's. Read when Ray is
    # first imported.
    os.environ.setdefault("RAY_DEDUP_LOGS_ALLOW_REGEX", r"\[trl_ext\]")
    import ray

    from trl_ext.errors import UsageError

    if ray.is_initialized():
        return
    where = address or os.environ.get("RAY_ADDRESS") or "auto"
    fix = "start one (ray start --head), or give its address (RAY_ADDRESS, or address=)"
    host, _, port = where.rpartition("://")[2].rpartition(":")
    if host and port.isdigit() and not _answers(host, int(port), seconds):
        raise UsageError(f"no Ray cluster at {where}: nothing answered there within {seconds:.0f} s; {fix}.")
    try:
        ray.init(address=where, configure_logging=False)
    except ConnectionError as exc:
        raise UsageError(f"no Ray cluster at {where} ({failures.first_line(exc)}); {fix}.") from None


def _answers(host: str, port: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, end - time.monotonic()))):
                return True
        except OSError:
            if time.monotonic() >= end:
                return False
            time.sleep(1.0)


def run(task: Task, asked: tuple[int, int] | None, say, max_failures: int | None = None,
        wait: float | None = None):
    """Run ``task`` on a worker group of the connected cluster until the run ends.

    Args:
        task: what every worker runs (``Task.run``, ``Task.output_dir`` set).
        asked: ``(MIN, MAX)`` workers, or None for the default (``cluster.size_group``).
        say: prints one line.
        max_failures: lost groups in a row without a new checkpoint that the run survives (default
            ``failure_limit.max_failures()``).
        wait: seconds to wait for room (default ``TRL_EXT_RAY_WAIT_S``, else 300).

    Returns:
        Ray's ``Result`` of the run's last group (its ``checkpoint``, ``metrics``, ``return_value``).

    Raises:
        UsageError: the cluster lacks room for the minimum after ``wait``.
        RunFailed: an error of the run's own, more lost groups in a row than ``max_failures``, a group that never
            started.
    """
    import ray

    wait = environment.RAY_WAIT.number() if wait is None else wait
    max_failures = failure_limit.max_failures() if max_failures is None else max_failures
    group = cluster.size_group(cluster.alive(ray.nodes()), asked)
    cluster.wait_for_room(ray.nodes, group, wait, say)
    if task.claim:  # before Ray writes its own files there
        ownership.claim(task.output_dir, task.run)
    failure_limit.started_by_hand(task.output_dir, task.run)
    task.most = group.workers[1] if group.elastic else 0
    task.per_worker = dict(group.per_worker)
    starts = start_attempts(wait)
    # Ray Train's print() to its logger as well: it tees what libraries print into a redirected stdout (a StringIO)
    # to the job's log. Off, the workers' output reaches the job's log as it is.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    say(f"Ray run {task.run}: {group.describe()} on {len(cluster.alive(ray.nodes()))} node(s); output and Ray's "
        f"storage for the run: {task.output_dir}")
    while True:
        result = _fit(task, group, max_failures, wait, starts)
        value = result.return_value if isinstance(result.return_value, dict) else {}
        if GROW not in value:
            return result
        say(f"Ray run {task.run}: stopped at step {value[GROW]} with its checkpoint to grow; starting the worker "
            "group again with what the cluster has")
        # Ray Train sizes the new group from its AutoscalingCoordinator's view of the nodes, ticked every 20 s: the node
        # that made room may not be in it yet, and the group came back at its old size (seen under load)
        cluster.refresh_view(say)


def start_attempts(wait: float) -> int:
    """How many times Ray Train may start a worker group within ``wait``, each start waiting
    ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` (set here to ``START_SECONDS`` unless the user set it; Ray Train reads it
    from the driver's environment).

    Args:
        wait: seconds for a group that cannot start (``TRL_EXT_RAY_WAIT_S``).

    Returns:
        Ray's ``controller_failure_limit``, at least 1.
    """
    seconds = float(os.environ.setdefault(START_ENV, str(START_SECONDS)))
    return max(1, math.ceil(wait / seconds))


def _fit(task: Task, group: cluster.Group, max_failures: int, wait: float, starts: int):
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchTrainer

    from trl_ext.launching.ray import controller, standby, worker

    hook = standby.worker_env()  # the spares' imports (``standby``): in the workers' runtime environment
    trainer = TorchTrainer(
        worker.train, train_loop_config={"task": task},
        scaling_config=ScalingConfig(num_workers=group.size(), resources_per_worker=dict(group.per_worker),
                                     use_gpu=group.use_gpu, placement_strategy="SPREAD" if group.spread else "PACK",
                                     elastic_resize_monitor_interval_s=NEVER),
        run_config=RunConfig(
            name=os.path.basename(task.output_dir), storage_path=os.path.dirname(task.output_dir),
            # Ray's own count of lost groups counts every one, even after new checkpoints: off (-1); the run's rule
            # decides instead, in the controller (``Verdict``), as under every orchestrator (``failure_limit``)
            failure_config=FailureConfig(max_failures=-1,
                                         controller_failure_limit=starts),
            callbacks=[controller.Verdict(task.run, task.output_dir, max_failures)],
            worker_runtime_env={"env_vars": hook} if hook else None))
    try:
        return trainer.fit()
    except TrainingFailedError as exc:
        raise _failed(task, exc, wait) from None


def _failed(task: Task, exc: BaseException, wait: float) -> RunFailed:
    """One line for a run that failed (Ray's own traceback is in the log above it)."""
    cause = getattr(exc, "controller_failure", None)
    if isinstance(cause, failures.RankError):
        return RunFailed(f"Ray run {task.run} failed: {cause}", kind=GAVE_UP if cause.kind == GAVE_UP else ERROR)
    if cause is not None and "StartupTimeout" in type(cause).__name__:
        return RunFailed(f"Ray run {task.run} failed: its worker group could not start within {wait:.0f} s "
                         f"({WAIT_ENV}); the cluster lacks the room it had when the run began", kind="setup")
    return RunFailed(f"Ray run {task.run} failed: {failures.first_line(cause or exc)}", kind="setup")


def printer(line: str) -> None:
    """The driver's lines: ``[trl_ext]``, to stderr, flushed (``ray job logs`` shows them with the workers')."""
    print(f"[trl_ext] {line}", file=sys.stderr, flush=True)


def new_run_name() -> str:
    """A run identity for a driver no orchestrator names (a notebook): the time and this process."""
    return f"ray-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
