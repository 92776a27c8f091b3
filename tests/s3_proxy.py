"""A store slowed or silenced on purpose: a TCP proxy on loopback in front of a test S3 server (``tests/s3_server``).

``S3Proxy`` runs on threads of the test process. It passes every byte through, at most ``rate`` bytes a second (all
connections together, both ways), so that uploads are still in flight, or queued, when a script returns; and once
``stall_when`` exists (a file the script writes just before it returns) it stalls: every connection, open or new, is
held without forwarding anything and never answered, as a store that stops answering does (the client sees no
refusal and no reset, only silence). ``stop()`` closes every connection.

Our own rather than a library (toxiproxy, mitmproxy): the test needs two behaviours, a rate and a stall triggered by a
file, on threads, with no extra program to install. Nothing here imports trl_ext.
"""

import contextlib
import socket
import threading
import time
from pathlib import Path

CHUNK = 16 * 1024  # bytes forwarded at a time: a throttled stream moves in small, even steps


class S3Proxy:
    """Forward ``127.0.0.1:<port>`` to ``127.0.0.1:<upstream_port>``.

    Args:
        upstream_port: the S3 server's port.
        rate: the most bytes per second through the proxy, all connections and both directions together (None: as
            fast as loopback goes).
        stall_when: once this file exists, every connection is held without forwarding (None: never).
    """

    def __init__(self, upstream_port: int, rate: float | None = None, stall_when: Path | None = None):
        self.upstream_port, self.rate, self.stall_when = upstream_port, rate, stall_when
        self.stalled = threading.Event()
        self.closed = threading.Event()
        self.forwarded = 0  # bytes passed through, for the tests' messages
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._next_send = 0.0  # the throttle: when the next byte may go (time.monotonic)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, server_env: dict[str, str]) -> dict[str, str]:
        """A server's ``env`` (its credentials) with the endpoint replaced by this proxy's."""
        return {**server_env, "AWS_ENDPOINT_URL": self.endpoint}

    def start(self) -> "S3Proxy":
        self._thread(self._accept)
        if self.stall_when is not None:
            self._thread(self._watch)
        return self

    def stop(self) -> None:
        """Close the listener and every connection; the threads end."""
        self.closed.set()
        with self._lock:
            sockets, self._sockets = [self._listener, *self._sockets], []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()
        for thread in self._threads:
            thread.join(5)

    def __enter__(self) -> "S3Proxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------------ threads
    def _thread(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name="s3-proxy")
        thread.start()
        self._threads.append(thread)

    def _keep(self, sock: socket.socket) -> None:
        with self._lock:
            if self.closed.is_set():
                sock.close()
            else:
                self._sockets.append(sock)

    def _watch(self) -> None:
        while not self.closed.wait(0.05):
            if self.stall_when.exists():
                self.stalled.set()
                return

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed by stop()
                return
            self._keep(client)
            if self.stalled.is_set():
                continue  # held open, never read, never answered
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=10)
            except OSError:  # the server is down: the client sees its connection closed, as with no proxy
                client.close()
                continue
            self._keep(upstream)
            done = threading.Barrier(2, action=lambda c=client, u=upstream: (c.close(), u.close()))
            self._thread(self._pump, client, upstream, done)
            self._thread(self._pump, upstream, client, done)

    def _pump(self, source: socket.socket, target: socket.socket, done: threading.Barrier) -> None:
        """Copy ``source`` to ``target`` until ``source`` ends; both sockets close once both directions have."""
        source.settimeout(0.2)  # to see stop()
        try:
            while not self.closed.is_set():
                try:
                    data = source.recv(CHUNK)
                except TimeoutError:
                    continue
                if not data:
                    with contextlib.suppress(OSError):
                        target.shutdown(socket.SHUT_WR)
                    break
                self._throttle(len(data))
                while self.stalled.is_set() and not self.closed.is_set():
                    time.sleep(0.1)  # held: never forwarded, never answered
                if self.closed.is_set():
                    break
                target.sendall(data)
                self.forwarded += len(data)
        except OSError:
            pass
        with contextlib.suppress(threading.BrokenBarrierError):
            done.wait(timeout=None if not self.closed.is_set() else 0)

    def _throttle(self, size: int) -> None:
        """Wait until ``size`` more bytes fit in the rate (one schedule shared by every connection)."""
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_send)
            self._next_send = start + size / self.rate
        if start > now:
            time.sleep(start - now)
