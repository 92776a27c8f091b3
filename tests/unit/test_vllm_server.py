"""Server mode's bounded waits, against a real HTTP server (tests/vllm_server_standin.py): TRL's client waits for a
stalled server without end; trl_ext's answers within its bound, once, with the server and the request named."""

import threading
import time

import pytest

pytest.importorskip("requests")

import trl.generation.vllm_client as vllm_client  # noqa: E402

from tests.upstream import still_needed  # noqa: E402
from tests.vllm_server_standin import Fault, StandInServer  # noqa: E402
from trl_ext.errors import ServerError  # noqa: E402
from trl_ext.trainers import vllm_server  # noqa: E402

TIMEOUT = 1.0


@pytest.fixture(autouse=True)
def vllm_installed(monkeypatch):
    """TRL's client refuses to start without vLLM, which cannot be installed on CPU; the HTTP side needs none of it."""
    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *args, **kwargs: True)


def client(server, **kwargs):
    return vllm_server.BoundedVLLMClient(base_url=server.url, request_timeout=TIMEOUT, **kwargs)


def test_generates_through_a_healthy_server():
    with StandInServer(vocab_size=50) as server:
        out = client(server).generate(prompts=[[1, 2, 3], [4]], n=2, max_tokens=5)
    assert out["prompt_ids"] == [[1, 2, 3], [4]]
    assert [len(ids) for ids in out["completion_ids"]] == [5] * 4
    assert server.counts["/v1/completions"] == 1


@pytest.mark.parametrize("how, what", [("stall", "did not answer within 1 s"), ("close", "was cut")])
def test_a_failed_generation_request_raises_at_once_naming_the_server(how, what):
    with StandInServer(faults=(Fault("/v1/completions", 1, how),)) as server:
        bounded = client(server)
        start = time.monotonic()
        with pytest.raises(ServerError) as raised:
            bounded.generate(prompts=[[1]], n=1, max_tokens=2)
        elapsed = time.monotonic() - start
    assert f"vLLM server {server.url}: POST /v1/completions {what}" in str(raised.value)
    assert raised.value.kind == "server" and bounded.last_failure in str(raised.value)
    assert server.counts["/v1/completions"] == 1  # not retried: a retry would multiply the bound
    assert elapsed < TIMEOUT + 10  # a stalled request is held until the server stops: without the bound, forever


def test_connection_failures_keep_trls_retries():
    with StandInServer() as server:
        bounded = client(server)
    retries = bounded.session.get_adapter(server.url).max_retries
    assert (retries.total, retries.connect, retries.read, retries.status) == (5, 5, 0, 3)


def test_a_server_that_never_answers_its_health_check_is_given_up_on_after_vllm_server_timeout():
    with StandInServer(faults=tuple(Fault("/health", i, "stall") for i in range(1, 10))) as server:
        start = time.monotonic()
        with pytest.raises(ServerError, match="can't be reached at .* after 1 seconds"):
            client(server, connection_timeout=1.0)
        assert time.monotonic() - start < 1.0 + TIMEOUT + 10  # the stalls last until the server stops


def test_trls_own_client_waits_for_a_stalled_server_without_end():
    """What the bound is for (trl#6973): the same stall leaves TRL's client waiting."""
    with StandInServer(faults=(Fault("/v1/completions", 1, "stall"),)) as server:
        trl_client = vllm_client.VLLMClient(base_url=server.url)
        waiting = threading.Thread(target=trl_client.generate, kwargs={"prompts": [[1]], "max_tokens": 2},
                                   daemon=True)
        waiting.start()
        waiting.join(TIMEOUT + 1)
        still_needed("bounded-vllm-client", waiting.is_alive(), "TRL's client waiting on a stalled server")


def test_the_watchdog_ends_the_process_only_when_the_block_overruns(monkeypatch):
    expired = []
    monkeypatch.setattr(vllm_server, "_expire", expired.append)
    with vllm_server.watchdog(5.0, lambda: "too slow"):
        pass
    with vllm_server.watchdog(0.1, lambda: "too slow"):
        time.sleep(0.5)
    assert expired == ["too slow"]
