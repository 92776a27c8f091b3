"""A lost node is reported dead to Ray's GCS only where its raylet is gone (refused or no answer), through the call a
raylet makes when it shuts down; a raylet that still answers, a node Ray already counts dead and a node that was not
lost are left to Ray. The GCS here is a real gRPC server with Ray's own service definition, recording what it gets."""

import socket
from concurrent import futures

import pytest

pytest.importorskip("ray.train")
grpc = pytest.importorskip("grpc")

from ray.core.generated import common_pb2, gcs_service_pb2, gcs_service_pb2_grpc  # noqa: E402

from tests.ray.cluster import free_port as _closed_port  # noqa: E402 - nothing listens there once it returns
from trl_ext.launching.ray import node_death  # noqa: E402


class _Gcs(gcs_service_pb2_grpc.NodeInfoGcsServiceServicer):
    def __init__(self, code: int = 0):
        self.requests, self.code = [], code

    def UnregisterNode(self, request, context):  # noqa: N802 - Ray's RPC name
        self.requests.append(request)
        return gcs_service_pb2.UnregisterNodeReply(status=gcs_service_pb2.GcsStatus(code=self.code, message="no"))


@pytest.fixture
def gcs():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = _Gcs()
    gcs_service_pb2_grpc.add_NodeInfoGcsServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(grace=None)


def _node(node_id: str, port: int, alive: bool = True) -> dict:
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": port}


def test_only_a_lost_node_whose_raylet_is_gone_is_reported_dead(gcs):
    servicer, address = gcs
    gone, answers, other, dead = "ab" * 28, "cd" * 28, "ef" * 28, "12" * 28
    with socket.socket() as listening:  # a live raylet's port
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        nodes = [_node(gone, _closed_port()), _node(answers, listening.getsockname()[1]),
                 _node(other, _closed_port()), _node(dead, _closed_port(), alive=False)]
        lines = []
        reported = node_death.report_dead({gone, answers, dead}, lines.append, nodes, address)
    assert reported == {gone}
    [request] = servicer.requests
    assert request.node_id == bytes.fromhex(gone)
    assert request.node_death_info.reason == common_pb2.NodeDeathInfo.UNEXPECTED_TERMINATION
    assert "its workers were unreachable and its raylet at 127.0.0.1:" in request.node_death_info.reason_message
    assert lines == [f"node {gone[:8]}'s raylet refused: reported dead to Ray without waiting for its health checks",
                     f"node {answers[:8]}'s raylet still answers: Ray's health checks decide whether it is lost"]


def test_a_report_the_gcs_refuses_or_cannot_take_is_said_and_left_to_rays_checks(gcs):
    servicer, address = gcs
    servicer.code = 5
    lines = []
    assert node_death.report_dead({"ab" * 28}, lines.append, [_node("ab" * 28, _closed_port())], address) == set()
    assert lines == [f"could not report node {'ab' * 4} dead to Ray (ServerError: the GCS answered 5: no)"]
    lines.clear()
    nowhere = f"127.0.0.1:{_closed_port()}"
    assert node_death.report_dead({"ab" * 28}, lines.append, [_node("ab" * 28, _closed_port())], nowhere) == set()
    assert len(lines) == 1 and lines[0].startswith(f"could not report node {'ab' * 4} dead to Ray (")


def test_a_raylet_that_takes_no_connection_is_told_from_one_that_does():
    assert node_death.raylet_gone("127.0.0.1", _closed_port()) == "refused"
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert node_death.raylet_gone("127.0.0.1", listening.getsockname()[1]) is None


def test_a_raylet_whose_machine_does_not_answer_is_reported_dead_after_the_probe(gcs, monkeypatch):
    """A machine that is gone answers nothing: its port neither refuses nor accepts. Here: a listening socket whose
    queue of connections is full, so the kernel drops further connection requests unanswered."""
    servicer, address = gcs
    monkeypatch.setattr(node_death, "PROBE_S", 0.5)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        port, queued = silent.getsockname()[1], []
        try:
            for _ in range(8):  # fill the accept queue (its length is the kernel's to decide)
                queued.append(socket.create_connection(("127.0.0.1", port), timeout=0.2))
        except TimeoutError:
            pass
        else:
            pytest.fail("the kernel queued 8 connections on a backlog of 0: no port to leave unanswered")
        lines = []
        assert node_death.report_dead({"ab" * 28}, lines.append, [_node("ab" * 28, port)], address) == {"ab" * 28}
        for connection in queued:
            connection.close()
    assert lines == [f"node {'ab' * 4}'s raylet gave no answer in 0.5 s: reported dead to Ray without waiting for its "
                     "health checks"]
    [request] = servicer.requests
    assert request.node_death_info.reason_message.endswith("gave no answer in 0.5 s")
