"""vLLM server mode with a bound on every wait (GRPO, RLOO with ``use_vllm=True, vllm_mode="server"``).

TRL's ``VLLMClient`` (1.14-1.16) sends its HTTP requests without a timeout, so a server that accepted the connection
and then stalled is waited for without end (trl#6973), and its weight transfer waits in NCCL for as long as the
server's workers do not receive. While rank 0 waits, every other rank waits in a collective (the prompts' gather, the
completions' broadcast, a weight gather): one stalled server hangs the whole job, with no message.

Here every wait has the bound ``vllm_request_timeout``:
- each HTTP request gets it as its read timeout, and a read that timed out or was cut is not retried (TRL retries it
  5 times with a backoff of 2: about 6 times the bound, plus a minute); connection failures are retried as in TRL;
- the NCCL parts (joining the weight-transfer group, each weight sync) run under a watchdog, at the bound plus
  ``WATCHDOG_GRACE`` (so that a request's own timeout, the clearer error, fires first): a
  blocked NCCL call cannot be interrupted from Python, so on expiry the watchdog prints what happened and ends the
  process, as NCCL's own watchdog does, and the launcher stops the other ranks.

Imported only in server mode: ``requests`` is installed there (TRL's client needs it), not necessarily elsewhere.

A failed request raises ``ServerError`` on rank 0, naming the server, the request and the training step; the process
exits, and the other ranks, waiting for it in a collective, stop when it does. The checkpoints already committed are
untouched: a save never overlaps a generation or a sync.
"""

import contextlib
import os
import sys
import threading
import time
from urllib.parse import urlparse

import requests
from trl.generation.vllm_client import VLLMClient

from trl_ext.errors import ServerError
from trl_ext.process import env_rank
from trl_ext.settings.trainer_options import VLLMServerOptions

CONNECT_TIMEOUT = 10.0  # seconds to open a connection (each attempt; connection failures are retried as in TRL)
WATCHDOG_GRACE = 30.0  # the watchdog fires this long after the request bound, so a request's own timeout fires first


def _what_failed(exc: requests.RequestException, timeout: float) -> str:
    text = str(exc)
    if isinstance(exc, requests.Timeout) or "timed out" in text.lower():
        return f"did not answer within {timeout:g} s (vllm_request_timeout)"
    if "RemoteDisconnected" in text or "Connection aborted" in text or "reset by peer" in text:
        return "was cut: the server closed the connection without answering"
    if "refused" in text.lower():
        return "was refused: nothing listens there (the server is down or the address is wrong)"
    return f"failed: {text.splitlines()[0][:300]}"


class BoundedSession(requests.Session):
    """A ``requests.Session`` whose requests all have a timeout, whose cut or timed-out reads are not retried, and
    whose failures are ``ServerError``s naming the server and the request; the last failure is kept for the
    watchdog's message.

    Args:
        timeout: seconds to wait for an answer (``vllm_request_timeout``).
    """

    def __init__(self, timeout: float):
        super().__init__()
        self.timeout = timeout
        self.last_failure: str | None = None

    def mount(self, prefix, adapter):
        # TRL mounts its retrying adapter; a read that failed is a stalled or dying server, and retrying it multiplies
        # the bound (connection failures, and 5xx answers, keep TRL's retries).
        retries = getattr(adapter, "max_retries", None)
        if retries is not None and hasattr(retries, "new"):
            adapter.max_retries = retries.new(read=0)
        super().mount(prefix, adapter)

    def request(self, method, url, *args, **kwargs):
        kwargs.setdefault("timeout", (CONNECT_TIMEOUT, self.timeout))
        try:
            return super().request(method, url, *args, **kwargs)
        except requests.RequestException as exc:
            parsed = urlparse(url)
            self.last_failure = (f"vLLM server {parsed.scheme}://{parsed.netloc}: {method} {parsed.path} "
                                 f"{_what_failed(exc, self.timeout)}")
            raise ServerError(self.last_failure + ".") from None  # the line says it all; urllib3's chain is 100 lines


class BoundedVLLMClient(VLLMClient):
    """TRL's ``VLLMClient`` with a bounded wait on every HTTP request (see the module docstring).

    Args:
        *args, **kwargs: TRL's ``VLLMClient`` arguments.
        request_timeout: seconds to wait for each answer of the server.
    """

    def __init__(self, *args, request_timeout: float = VLLMServerOptions.vllm_request_timeout, **kwargs):
        self.request_timeout = request_timeout
        super().__init__(*args, **kwargs)

    # TRL builds its session inline in __init__ (``self.session = requests.Session()``) and then uses it directly in
    # most methods: the setter gives it a bounded one instead of the fresh, empty one TRL made.
    @property
    def session(self) -> requests.Session:
        return self._session

    @session.setter
    def session(self, value: requests.Session) -> None:
        self._session = value if isinstance(value, BoundedSession) else BoundedSession(self.request_timeout)

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0):
        """Wait up to ``total_timeout`` seconds (``vllm_server_timeout``) for the server's ``/health`` to answer 200.

        TRL's check sends each probe without a timeout, so a server that accepts the connection and never answers
        is waited for without end; here each probe waits at most ``request_timeout``.
        """
        deadline = time.monotonic() + total_timeout
        while True:
            try:
                response = self.session.get(f"{self.base_url}/health", timeout=(CONNECT_TIMEOUT, self.request_timeout))
                if response.status_code == 200:
                    self.host = response.headers.get("X-Forwarded-For", self.host)
                    return
            except ServerError as exc:
                if time.monotonic() >= deadline:
                    raise ServerError(f"The vLLM server can't be reached at {self.base_url} after {total_timeout:g} "
                                      f"seconds (vllm_server_timeout): {exc} Start it with `trl vllm-serve` or "
                                      "`vllm serve`, or check the host and port.") from exc
            if time.monotonic() >= deadline:
                raise ServerError(f"The vLLM server at {self.base_url} was not healthy after {total_timeout:g} "
                                  "seconds (vllm_server_timeout).")
            time.sleep(retry_interval)

    @property
    def last_failure(self) -> str | None:
        """The last request that failed, in words (None if none did)."""
        return getattr(self.session, "last_failure", None)


def _expire(message: str) -> None:
    sys.stderr.write(f"\n[trl_ext] rank {env_rank()}: {message}\n")  # after a progress bar
    sys.stderr.flush()
    os._exit(1)  # the main thread is blocked in NCCL: nothing else can end it


@contextlib.contextmanager
def watchdog(seconds: float, describe):
    """End the process (exit code 1) if the block has not finished within ``seconds``.

    For waits that cannot be interrupted from Python (NCCL's weight transfer). The block's own errors pass through
    unchanged.

    Args:
        seconds: the bound.
        describe: called on expiry; returns the one-line message printed before the process ends.
    """
    timer = threading.Timer(seconds, lambda: _expire(describe()))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
