"""On the Ray Train controller: a worker group's failure told apart (``failures``) before Ray's ``FailureConfig`` acts.

- An error of the run's own ends the run at once: raised here, it becomes a controller error, which Ray's failure
  policy never retries; the driver then says it in one line (``group``).
- A lost worker or node: counted by the run's own rule (``failure_limit.count_lost_group``: lost groups in a row
  without a new committed checkpoint); past its limit the run gives up, raised here as above; else Ray restarts the
  group (its own ``max_failures`` is off). First, the nodes whose workers Ray could no longer reach are reported
  dead to Ray where their raylets are gone too (``node_death``), else given a bounded time for Ray's health checks
  to mark them, and Ray's view of the cluster is refreshed (patch
  ``ray-fresh-cluster-view``), after every lost group: an elastic group restarted on a stale view is sized for the
  dead node too and waits out a whole start timeout for workers that cannot start.
"""

import time

import ray
from ray.train import UserCallback

from trl_ext.errors import GAVE_UP
from trl_ext.launching.ray import cluster, failures, node_death
from trl_ext.placement import failure_limit
from trl_ext.placement.outcome import ERROR

NODE_DEATH_WAIT_S = 60.0  # at most this long for Ray to mark a lost node dead before the group restarts


class Verdict(UserCallback):
    """The controller's callback (``RunConfig(callbacks=[Verdict(run)])``).

    Args:
        run: the run's name, for its lines.
        output_dir: the run's output directory, where its record counts the lost groups.
        limit: lost groups in a row without a new checkpoint that the run survives.
    """

    def __init__(self, run: str, output_dir: str, limit: int):
        self.run, self.output_dir, self.limit = run, output_dir, limit

    def after_exception(self, run_context, worker_exceptions: dict) -> None:
        kind, line = failures.verdict(worker_exceptions)
        if kind == ERROR:
            raise failures.RankError(f"{line} (an error of the run's own: not retried)", kind=ERROR)
        in_a_row, newest, gave_up = failure_limit.count_lost_group(self.output_dir, self.limit)
        if gave_up:
            raise failures.RankError(failure_limit.gave_up_line(
                f"Ray run {self.run}", in_a_row, newest, self.limit, "the run ends") +
                f" The last: {line}", kind=GAVE_UP)
        _say(f"Ray run {self.run}: {line}; the worker group restarts on the nodes left and resumes from the newest "
             f"committed checkpoint ({in_a_row} lost group(s) in a row without a new checkpoint; the limit is "
             f"{self.limit}, {failure_limit.setting()})")
        lost = failures.lost_nodes(worker_exceptions)
        if lost:
            nodes, started = ", ".join(sorted(node[:8] for node in lost)), time.monotonic()
            node_death.report_dead(lost, _say)
            if _marked_dead(lost, NODE_DEATH_WAIT_S):
                _say(f"Ray marked node(s) {nodes} dead {time.monotonic() - started:.1f} s later")
            else:
                _say(f"Ray still counts node(s) {nodes} as alive after {NODE_DEATH_WAIT_S:.0f} s")
        # Always: a node Ray marked dead before this ran (its workers reported died, not unreachable) leaves the view
        # as stale, and the group would be sized for it and wait out a whole start timeout (seen with 1-s checks)
        cluster.refresh_view(_say)


def _marked_dead(node_ids: set[str], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        live = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
        if not node_ids & live:
            return True
        time.sleep(0.5)
    return False


def _say(line: str) -> None:
    print(f"[trl_ext] {line}", flush=True)
