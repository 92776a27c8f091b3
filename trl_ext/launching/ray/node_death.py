"""A lost node reported dead to Ray at once, on the Ray Train controller, where that is certain: its workers were
unreachable (``failures.lost_nodes``) and its raylet no longer takes a connection (refused: the process is gone; no
answer: the machine is). Ray itself marks a node dead only once its health checks have missed (3 s x 5 at Ray's
defaults, the cluster's setting, not the job's), and until then the worker group cannot restart on the nodes left: 10.8
s of a 26.9-s recovery (bench/RESULTS.md, 2026-11-28).

The report is the one a raylet sends when it shuts down (``UnregisterNode``, patch ``ray-unregister-lost-node``): Ray
then does what a failed health check does (the node's actors and placement groups fail over). A raylet that still
answers is left to Ray's own checks.
"""

import socket

from trl_ext import patches
from trl_ext.errors import ServerError, SetupError
from trl_ext.launching.ray import failures

PROBE_S = 2.0  # a live raylet's listening socket is answered by the kernel, however busy the process is


def raylet_gone(address: str, port: int, timeout: float | None = None) -> str | None:
    """Why a raylet no longer takes connections, or None if it does.

    Args:
        address: the node's ``NodeManagerAddress``.
        port: its ``NodeManagerPort``.
        timeout: seconds to wait for the connection (default: ``PROBE_S``).

    Returns:
        ``"refused"``, ``"gave no answer in 2 s"`` (the machine is gone or cut off), another OS error's text, or None.
    """
    timeout = PROBE_S if timeout is None else timeout
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return None
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return f"gave no answer in {timeout:g} s"
    except OSError as exc:  # no route to host, network unreachable
        return exc.strerror or type(exc).__name__


def report_dead(node_ids: set[str], say, nodes: list[dict] | None = None, gcs_address: str | None = None) -> set[str]:
    """Reports to Ray's GCS, as dead, each of ``node_ids`` that Ray still counts alive and whose raylet is gone.

    Args:
        node_ids: the lost nodes' hex ids.
        say: prints one line.
        nodes: the cluster's nodes as ``ray.nodes()`` lists them (default: asked now).
        gcs_address: the GCS's ``host:port`` (default: this Ray process's).

    Returns:
        The ids reported; none where the patch does not apply, a raylet still answers, or the report failed (said in
        one line: Ray's health checks then decide, as without it).
    """
    if not patches.applies("ray-unregister-lost-node"):
        return set()
    if nodes is None or gcs_address is None:
        import ray

        nodes, gcs_address = ray.nodes(), ray.get_runtime_context().gcs_address
    reported = set()
    for node in nodes:
        if node["NodeID"] not in node_ids or not node.get("Alive"):
            continue
        why = raylet_gone(node["NodeManagerAddress"], node["NodeManagerPort"])
        if why is None:
            say(f"node {node['NodeID'][:8]}'s raylet still answers: Ray's health checks decide whether it is lost")
            continue
        try:
            _unregister(gcs_address, node["NodeID"], f"trl_ext: its workers were unreachable and its raylet at "
                        f"{node['NodeManagerAddress']}:{node['NodeManagerPort']} {why}")
        except Exception as exc:  # noqa: BLE001 - Ray's health checks then mark it, as without the report
            say(f"could not report node {node['NodeID'][:8]} dead to Ray ({failures.first_line(exc)})")
            continue
        say(f"node {node['NodeID'][:8]}'s raylet {why}: reported dead to Ray without waiting for its health checks")
        reported.add(node["NodeID"])
    return reported


def _unregister(gcs_address: str, node_id: str, reason: str, timeout: float = 10.0) -> None:
    """What a raylet sends the GCS when it shuts down, sent for it (patch ``ray-unregister-lost-node``)."""
    if not patches.applies("ray-unregister-lost-node"):
        raise SetupError("this Ray release has no UnregisterNode call as trl_ext knows it")
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import common_pb2, gcs_service_pb2, gcs_service_pb2_grpc

    death = common_pb2.NodeDeathInfo(reason=common_pb2.NodeDeathInfo.UNEXPECTED_TERMINATION, reason_message=reason)
    channel = init_grpc_channel(gcs_address)
    try:
        reply = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).UnregisterNode(
            gcs_service_pb2.UnregisterNodeRequest(node_id=bytes.fromhex(node_id), node_death_info=death),
            timeout=timeout)
    finally:
        channel.close()
    if reply.status.code:
        raise ServerError(f"the GCS answered {reply.status.code}: {reply.status.message}")
