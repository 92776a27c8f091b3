"""What a Ray cluster can run: its nodes, the worker group trl_ext asks for on them, and a bounded wait for room.

The worker group's size follows the recipes' default on one machine (one process per GPU, 2 CPU processes without
one), cluster-wide: one worker per GPU of the cluster, each with a GPU; without GPUs, 2 workers per node, each with
half of the smallest node's CPUs (so that 2 fit on every node, spread across them). ``--num_processes N`` fixes the
size, ``MIN-MAX`` makes it elastic (Ray starts the group with what the cluster has, at least MIN).

Nothing here imports Ray: the functions take the nodes as ``ray.nodes()`` lists them.
"""

import math
import re
import time
from dataclasses import dataclass

from trl_ext import patches
from trl_ext.errors import UsageError
from trl_ext.launching.ray import failures

RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
CPU_WORKERS_PER_NODE = 2  # the recipes' default without a GPU (placement.orchestrators.CPU_PROCESSES_PER_NODE)


@dataclass(frozen=True)
class Group:
    """The worker group to ask Ray for.

    Args:
        workers: ``(MIN, MAX)``, equal for a fixed size.
        per_worker: each worker's resources (``{"CPU": 1, "GPU": 1}``, ``{"CPU": 4}``).
        spread: place the workers across the nodes (CPU workers) rather than fill each node first (GPUs).
    """

    workers: tuple[int, int]
    per_worker: dict
    spread: bool

    @property
    def elastic(self) -> bool:
        return self.workers[0] != self.workers[1]

    @property
    def use_gpu(self) -> bool:
        return self.per_worker.get("GPU", 0) > 0

    def size(self) -> int | tuple[int, int]:
        """``ScalingConfig(num_workers=...)``: a number, or ``(MIN, MAX)``."""
        return self.workers if self.elastic else self.workers[0]

    def describe(self) -> str:
        count = f"{self.workers[0]}-{self.workers[1]}" if self.elastic else str(self.workers[0])
        each = ", ".join(f"{_amount(v)} {k}" for k, v in self.per_worker.items())
        return f"{count} worker(s), each {each}"


def parse_workers(text: str | None) -> tuple[int, int] | None:
    """``--num_processes`` under Ray: ``N`` or ``MIN-MAX``.

    Args:
        text: the option's value (None: not given).

    Returns:
        ``(MIN, MAX)`` (``(N, N)`` for a number), or None.

    Raises:
        UsageError: not a number or a range of numbers of 1 or more, or a range whose minimum exceeds its maximum.
    """
    if text is None:
        return None
    match = RANGE.match(str(text))
    if not match:
        raise UsageError(f"--num_processes {text!r}: give a number of workers (4) or a range MIN-MAX (2-4) for an "
                         "elastic run.")
    low = int(match.group(1))
    high = int(match.group(2)) if match.group(2) is not None else low
    if low < 1 or low > high:
        raise UsageError(f"--num_processes {text!r}: a range MIN-MAX needs 1 <= MIN <= MAX.")
    return low, high


def alive(nodes: list[dict]) -> list[dict]:
    """The resources of the nodes that are up (``ray.nodes()``'s ``Resources`` of each node whose ``Alive`` is true)."""
    return [dict(node.get("Resources") or {}) for node in nodes if node.get("Alive")]


def size_group(nodes: list[dict], asked: tuple[int, int] | None) -> Group:
    """The worker group for a cluster with ``nodes`` (their resources) and ``--num_processes``.

    Args:
        nodes: each live node's resources (``alive``).
        asked: ``(MIN, MAX)`` from ``parse_workers``, or None for the default.

    Returns:
        The group: on GPUs one worker per GPU; else 2 workers per node with CPUs, each with half of the smallest such
        node's CPUs.
    """
    gpus = int(sum(node.get("GPU", 0) for node in nodes))
    if gpus:
        group = Group((gpus, gpus), {"CPU": 1, "GPU": 1}, spread=False)
    else:
        cpu_nodes = [node["CPU"] for node in nodes if node.get("CPU", 0) > 0]
        each = max(1, math.floor(min(cpu_nodes, default=2) / CPU_WORKERS_PER_NODE))
        count = CPU_WORKERS_PER_NODE * max(1, len(cpu_nodes))
        group = Group((count, count), {"CPU": each}, spread=True)
    return group if asked is None else Group(asked, group.per_worker, group.spread)


def room(nodes: list[dict], per_worker: dict) -> int:
    """How many workers of ``per_worker`` the nodes hold, node by node (a worker never spans nodes)."""
    total = 0
    for node in nodes:
        total += min((int(node.get(name, 0) // amount) for name, amount in per_worker.items() if amount > 0),
                     default=0)
    return total


def shortfall(nodes: list[dict], group: Group) -> str | None:
    """What the cluster lacks for the group's minimum, in words, or None when it has room.

    Args:
        nodes: each live node's resources.
        group: the group asked for.

    Returns:
        One line ("the cluster has 2 node(s) with 4 CPUs: room for 4 worker(s) of 1 CPU; 6 asked"), or None.
    """
    fits = room(nodes, group.per_worker)
    if fits >= group.workers[0]:
        return None
    totals = ", ".join(f"{_amount(sum(node.get(name, 0) for node in nodes))} {name}s"
                       for name in group.per_worker)
    asked = f"at least {group.workers[0]}" if group.elastic else str(group.workers[0])
    each = ", ".join(f"{_amount(v)} {k}" for k, v in group.per_worker.items())
    return (f"the Ray cluster has {len(nodes)} node(s) with {totals}: room for {fits} worker(s) of {each}; "
            f"{asked} asked")


def wait_for_room(list_nodes, group: Group, seconds: float, say, poll: float = 5.0, clock=time.monotonic,
                  sleep=time.sleep) -> None:
    """Return once the cluster's live nodes hold the group's minimum; until then say what is missing (once) and wait
    for nodes to join, at most ``seconds``.

    Args:
        list_nodes: returns the nodes as ``ray.nodes()`` does.
        group: the group asked for.
        seconds: how long to wait for nodes (0: refuse at once).
        say: prints one line.
        poll: how often to look again.

    Raises:
        UsageError: still no room after ``seconds``: what is missing, and how to fix it.
    """
    end = clock() + seconds
    missing = shortfall(alive(list_nodes()), group)
    if missing is None:
        return
    if seconds > 0:
        say(f"{missing}: waiting up to {seconds:.0f} s for nodes to join (TRL_EXT_RAY_WAIT_S)")
    while clock() < end:
        sleep(min(poll, max(0.0, end - clock())))
        missing = shortfall(alive(list_nodes()), group)
        if missing is None:
            return
    raise UsageError(f"{missing}. Add nodes (ray start --address ...), or ask for fewer workers with --num_processes "
                     "N (or a range MIN-MAX).")


def _amount(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def refresh_view(say) -> None:
    """Make Ray Train's view of the nodes current before it sizes the next worker group (patch
    ``ray-fresh-cluster-view``): after a lost node is marked dead, and before a group that stopped to grow starts again.

    Args:
        say: prints one line, where the refresh fails (Ray's own view, ticked every 20 s, then sizes the group).
    """
    try:
        refresh_ray_cluster_view()
    except Exception as exc:  # noqa: BLE001 - Ray's own view then sizes the group, as without the patch
        say(f"could not refresh Ray's view of the cluster ({failures.first_line(exc)})")


def refresh_ray_cluster_view(timeout: float = 30.0) -> None:
    """Make Ray's AutoscalingCoordinator look at the cluster's nodes now, so that the worker group Ray Train restarts
    next is sized for the nodes alive (patch ``ray-fresh-cluster-view``). On the Ray Train controller, once a lost node
    is marked dead; on the driver, before a group that stopped to grow starts again; nothing where the patch does not
    apply.

    Args:
        timeout: seconds to wait for the coordinator's answer.
    """
    if not patches.applies("ray-fresh-cluster-view"):
        return
    import ray
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    coordinator = get_or_create_autoscaling_coordinator()
    ray.get(coordinator.get_reserved_resources.remote("trl_ext", recompute=True), timeout=timeout)
