"""A private Ray cluster on this machine for tests and benchmarks: a head and a second node, each ``ray start`` with
a few logical CPUs, their own ports and a temporary directory of their own; the second node can be killed as a power
loss would (its raylet and every process under it, SIGKILL) and started again. Ray advertises the machine's own
address, not 127.0.0.1, for both.

Every process of the cluster is ended by its id when the cluster stops (``ray stop`` would end every Ray process of
this user on the machine, another session's included).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def missing_reason() -> str | None:
    """Why no Ray cluster can start here, or None."""
    try:
        import ray  # noqa: F401
        import ray.dashboard  # noqa: F401
        import ray.train  # noqa: F401
    except ImportError as exc:
        return f"Ray is not installed ({exc}); pip install 'trl_ext[ray]' (CI: .ci/ray.sh)"
    return None if os.path.exists(RAY) else f"no `ray` command next to {sys.executable}"


class RayCluster:
    """A started 2-node cluster (``with RayCluster(...) as cluster``).

    Args:
        cpus_per_node: each node's logical CPUs.
        env: the cluster's environment (its workers and jobs inherit it).
        system_config: Ray's internal settings for the head (faster failure detection in tests).
    """

    def __init__(self, cpus_per_node: int = 2, env: dict | None = None, system_config: dict | None = None):
        self.cpus = cpus_per_node
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
        self.env.pop("RAY_ADDRESS", None)
        self.system_config = system_config or {}
        self.temp = tempfile.mkdtemp(prefix="trlray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.port, self.dashboard = free_port(), free_port()
        self.ip = None
        self.head_raylet = self.node_raylet = None
        self.node_dir, self.starts = None, 2

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    @property
    def job_address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard}"

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def _ray_start(self, args: list[str]) -> None:
        subprocess.run([RAY, "start", "--disable-usage-stats", "--num-gpus", "0", "--num-cpus", str(self.cpus),
                        "--dashboard-agent-listen-port", str(free_port()), *args], env=self.env, check=True,
                       capture_output=True, text=True, timeout=180)

    def start(self) -> None:
        head = ["--head", "--port", str(self.port), "--temp-dir", self.temp, "--include-dashboard=true",
                "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard),
                "--ray-client-server-port", str(free_port())]
        if self.system_config:
            head += ["--system-config", json.dumps(self.system_config)]
        self._ray_start(head)
        self.head_raylet = self._raylets()[0]
        self.ip = self.head_raylet.cmdline()[[a.startswith("--node_ip_address") for a in
                                             self.head_raylet.cmdline()].index(True)].split("=", 1)[1]
        self.start_node()

    def start_node(self) -> None:
        """The second node (again, after ``kill_node``)."""
        # A temporary directory of its own: each node's log monitor forwards every log file under its directory, and
        # two nodes sharing one would forward every line twice.
        # A fresh one when the node comes back: its log monitor would forward the dead node's old logs again.
        self.node_dir = os.path.join(self.temp, f"n{self.starts}")
        self.starts += 1
        self._ray_start(["--address", self.address, "--temp-dir", self.node_dir])
        self.node_raylet = next(p for p in self._raylets() if p.pid != self.head_raylet.pid)

    def _raylets(self) -> list[psutil.Process]:
        found = [p for p in psutil.process_iter(["name", "cmdline", "create_time"])
                 if p.info["name"] == "raylet" and any(self.temp in a for a in (p.info["cmdline"] or []))]
        return sorted(found, key=lambda p: p.info["create_time"])

    def kill_node(self) -> float:
        """The second node as a power loss would end it: its raylet, its log monitor and everything under them (its
        workers, agents), SIGKILL; returns when."""
        family = {}
        for process in psutil.process_iter(["cmdline"]):
            if any(a.endswith(self.node_dir) or f"{self.node_dir}/" in a for a in (process.info["cmdline"] or [])):
                for member in [process, *process.children(recursive=True)]:
                    family[member.pid] = member
        family = list(family.values())
        when = time.time()
        for process in family:
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(family, timeout=10)
        return when

    def nodes_alive(self) -> int:
        import ray

        return sum(1 for node in ray.nodes() if node.get("Alive"))

    def submit(self, args: list[str], submission_id: str, env: dict | None = None, cwd: str | None = None,
               wait: bool = False) -> subprocess.CompletedProcess:
        """``ray job submit --submission-id ID [--no-wait] -- python ARGS`` with ``env`` in the job's runtime
        environment."""
        runtime = json.dumps({"env_vars": env or {}})
        return subprocess.run([RAY, "job", "submit", "--address", self.job_address, "--submission-id", submission_id,
                               "--runtime-env-json", runtime, *([] if wait else ["--no-wait"]), "--", sys.executable,
                               *args], env=self.env, cwd=cwd, capture_output=True, text=True, timeout=1800)

    def job(self, submission_id: str) -> dict:
        out = subprocess.run([RAY, "job", "status", "--address", self.job_address, submission_id, "--log-style",
                              "record"], env=self.env, capture_output=True, text=True, timeout=60).stdout
        return {"status": next((s for s in ("SUCCEEDED", "FAILED", "STOPPED", "RUNNING", "PENDING")
                                if f"status: {s}" in out or f"'{s}'" in out or s in out.split()), "UNKNOWN"),
                "text": out}

    def logs(self, submission_id: str) -> str:
        return subprocess.run([RAY, "job", "logs", "--address", self.job_address, submission_id], env=self.env,
                              capture_output=True, text=True, timeout=60).stdout

    def wait_job(self, submission_id: str, timeout: float) -> str:
        """The job's final status (SUCCEEDED, FAILED, STOPPED), waited for at most ``timeout`` seconds."""
        from ray.job_submission import JobSubmissionClient

        client = JobSubmissionClient(self.job_address)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            status = str(client.get_job_status(submission_id)).split(".")[-1]
            if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                return status
            time.sleep(1)
        raise TimeoutError(f"Ray job {submission_id} still running after {timeout} s")

    def stop(self) -> None:
        """Every process of the cluster (those whose command line names its directory, and all under them), by id."""
        family = {}
        for process in psutil.process_iter(["cmdline"]):
            if any(self.temp in a for a in (process.info["cmdline"] or [])):
                for member in [process, *process.children(recursive=True)]:
                    family[member.pid] = member
        for process in family.values():
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(list(family.values()), timeout=10)
