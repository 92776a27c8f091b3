"""A node's request for standby processes (trl_ext.launching.ray.standby) reaches its raylet as Ray's own
``PrestartWorkers`` call: this job, the runtime environment the asking rank runs in (so that Ray gives the spares to
the next group's workers), the count, and a keep-alive past any run. The raylet here is a real gRPC server with Ray's
service definition, recording what it gets; Ray's own view of the node and the rank is stood in for."""

from concurrent import futures
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.train")
grpc = pytest.importorskip("grpc")

import ray  # noqa: E402
from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc  # noqa: E402

from trl_ext.launching.ray import standby  # noqa: E402

JOB, NODE = "02000000", "ab" * 28
RUNTIME_ENV = '{"env_vars": {"__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR": "trl_ext.launching.ray.standby.preload"}}'


class _Raylet(node_manager_pb2_grpc.NodeManagerServiceServicer):
    def __init__(self):
        self.requests = []

    def PrestartWorkers(self, request, context):  # noqa: N802 - Ray's RPC name
        self.requests.append(request)
        return node_manager_pb2.PrestartWorkersReply()


@pytest.fixture
def raylet(monkeypatch):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = _Raylet()
    node_manager_pb2_grpc.add_NodeManagerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    context = SimpleNamespace(get_node_id=lambda: NODE, get_job_id=lambda: JOB,
                              get_runtime_env_string=lambda: RUNTIME_ENV)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    monkeypatch.setattr(ray, "nodes", lambda: [
        {"NodeID": "cd" * 28, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": 1},  # another node: not asked
        {"NodeID": NODE, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": port}])
    yield servicer
    server.stop(grace=None)


def test_the_request_names_this_job_the_ranks_runtime_environment_and_the_count(raylet):
    standby._prestart(3)
    (request,) = raylet.requests
    assert request.language == common_pb2.PYTHON and request.job_id == bytes.fromhex(JOB)
    assert request.runtime_env_info.serialized_runtime_env == RUNTIME_ENV
    assert request.num_workers == 3 and request.keep_alive_duration_secs >= 7 * 24 * 3600


def test_where_the_raylet_does_not_answer_the_request_fails_within_its_bound(raylet, monkeypatch):
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": NODE, "NodeManagerAddress": "127.0.0.1",
                                                "NodeManagerPort": 1}])
    with pytest.raises(grpc.RpcError):
        standby._prestart(1, timeout=2)
