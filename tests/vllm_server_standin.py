"""A real HTTP server that answers TRL's ``VLLMClient`` as ``vllm serve`` does, with faults injected on demand.

vLLM cannot run on CPU. This server speaks the HTTP side of server mode (``/health``, ``/v1/models``,
``/server_info``, ``/get_world_size``, ``/v1/completions``, and the weight-update endpoints) over real sockets, so
TRL's client and trl_ext's bounds run unchanged. Completions are random token ids with log-probabilities of -1.

The NCCL side of the weight transfer is stood in for by ``POST /standin/weights`` (see
``tests/scripts/vllm_nccl_standin.py``): the trainer sends each tensor there without a timeout, as NCCL waits, so a
server whose weight-update handler died leaves the sender blocked, as a real transfer would be.

Faults: ``Fault(path, call, how)`` makes the ``call``-th request to ``path`` (1-based) ``"stall"`` (read the request,
never answer) or ``"close"`` (read the request, close the connection without an answer). After a fault on
``/update_weights``, ``/standin/weights`` stalls too: the server's receiving side is gone.
"""

import json
import random
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Fault:
    path: str
    call: int
    how: str  # "stall" or "close"


class StandInServer:
    """Serve on 127.0.0.1 in a background thread; ``url`` once started. Records every request in ``calls``."""

    def __init__(self, vocab_size: int = 64, faults: tuple[Fault, ...] = (), world_size: int = 1):
        self.vocab_size, self.faults, self.world_size = vocab_size, faults, world_size
        self.calls: list[str] = []
        self.counts: dict[str, int] = {}
        self.fault_times: list[tuple[str, float]] = []  # (path, time.monotonic()) of each injected fault
        self.received: list[tuple[str, int]] = []  # (tensor name, bytes) through the NCCL stand-in
        self.receiver_dead = False
        self._release = threading.Event()
        self._lock = threading.Lock()
        self._rng = random.Random(0)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._release.set()  # stalled handlers return
        self._server.shutdown()
        self._server.server_close()

    # -------------------------------------------------------------- request handling

    def _fault_for(self, path: str) -> str | None:
        with self._lock:
            self.calls.append(path)
            self.counts[path] = count = self.counts.get(path, 0) + 1
            if path == "/standin/weights" and self.receiver_dead:
                return "stall"
            for fault in self.faults:
                if fault.path == path and fault.call == count:
                    self.fault_times.append((path, time.monotonic()))
                    if path == "/update_weights":
                        self.receiver_dead = True
                    return fault.how
        return None

    def _answer(self, path: str, body: dict | None, headers) -> dict:
        if path in ("/health", "/start_weight_update", "/finish_weight_update", "/reset_prefix_cache",
                    "/init_weight_transfer_engine", "/update_weights"):
            return {"success": True}
        if path == "/v1/models":
            return {"data": [{"id": "stand-in", "object": "model"}]}
        if path == "/get_world_size":
            return {"world_size": self.world_size}
        if path == "/server_info":
            return {"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs"},
                                    "weight_transfer_config": {"backend": "nccl"}}}
        if path == "/standin/weights":
            self.received.append((headers.get("X-Name", ""), int(headers.get("Content-Length", 0))))
            return {"success": True}
        if path == "/v1/completions":
            return {"choices": [self._choice(prompt, body) for prompt in body["prompt"] for _ in range(body["n"])]}
        raise KeyError(path)

    def _choice(self, prompt: list[int], body: dict) -> dict:
        with self._lock:
            ids = [self._rng.randrange(self.vocab_size) for _ in range(body["max_tokens"])]
        tokens = [f"token_id:{i}" for i in ids]
        return {"prompt_token_ids": prompt, "token_ids": ids,
                "logprobs": {"tokens": tokens, "token_logprobs": [-1.0] * len(ids), "top_logprobs": [None] * len(ids)}}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _serve(self, has_body: bool):
                path = self.path.split("?")[0].rstrip("/") or "/"
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0))) if has_body else b""
                fault = server._fault_for(path)
                if fault == "stall":
                    server._release.wait()
                    return
                if fault == "close":
                    self.close_connection = True
                    self.connection.close()
                    return
                body = json.loads(raw) if raw and path != "/standin/weights" else None
                try:
                    payload = json.dumps(server._answer(path, body, self.headers)).encode()
                    status = 200
                except KeyError:
                    payload, status = b'{"detail": "Not Found"}', 404
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                self._serve(False)

            def do_POST(self):
                self._serve(True)

        return Handler
