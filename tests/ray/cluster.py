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


def _adopt_orphans() -> None:
    """Make this process the parent of every process it starts that loses its own (Linux's child subreaper): ``ray
    start`` leaves its daemons behind, and they are reaped here once ended, not left as zombies."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _raylet_failure(directory: str) -> str:
    """The fatal line a node's raylet left in its log under ``directory`` (its newest session), or ""."""
    for log in sorted(Path(directory).glob("session_*/logs/raylet.out"), key=os.path.getmtime, reverse=True)[:1]:
        fatal = [line for line in log.read_text(errors="replace").splitlines() if " C " in line[:40] or
                 "Check failed" in line]
        return fatal[-1][:500] if fatal else ""
    return ""


def _client_server_gave_up(directory: str) -> bool:
    """Whether the head's Ray Client server (which ``ray start --head`` starts and waits for) gave up waiting for its
    raylet to register: Ray waits a fixed 30 s (``services.get_node_with_retry``), which the raylet missed while the CI
    legs beside it installed and compiled (2026-12-02, no raylet log yet)."""
    for log in sorted(Path(directory).glob("session_*/logs/ray_client_server.err"), key=os.path.getmtime,
                      reverse=True)[:1]:
        return "Timed out waiting for node info" in log.read_text(errors="replace")
    return False


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
        return f"Ray is not installed ({exc}); pip install -e '.[ray]' (CI: .ci/ray.sh)"
    return None if os.path.exists(RAY) else f"no `ray` command next to {sys.executable}"


class RayCluster:
    """A started 2-node cluster (``with RayCluster(...) as cluster``).

    Args:
        cpus_per_node: each node's logical CPUs.
        env: the cluster's environment (its workers and jobs inherit it).
        system_config: Ray's internal settings for the head (faster failure detection in tests).
    """

    def __init__(self, cpus_per_node: int = 2, env: dict | None = None, system_config: dict | None = None,
                 cwd: str | None = None):
        self.cpus, self.cwd = cpus_per_node, cwd  # cwd: where the head starts, and so where jobs run
        # Ray's wait for its dashboard, 60 s by default, was missed beside the CI legs' installs (2026-12-02): the
        # dashboard imports its modules (aiohttp, grpc, OpenTelemetry) first, and 180 s did not suffice either.
        # Ray starts its workers (Ray Train's controller and workers, fit's ranks) at nice 15 (worker_niceness): beside
        # CI's other legs at nice 0 (load 15-20 on 2 cores) they got almost no CPU, and a 2-step fit() that takes 55 s
        # at load 5 had not started training after 5 minutes at load 16 (2026-12-03): here they run at nice 0, as the
        # references under accelerate launch do, and as on a node of their own.
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DASHBOARD_STARTUP_TIMEOUT_S": "900",
                    "RAY_worker_niceness": "0", **(env or {})}
        self.env.pop("RAY_ADDRESS", None)
        self.system_config = system_config or {}
        self.temp = tempfile.mkdtemp(prefix="trlray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.port, self.dashboard = free_port(), free_port()
        self.ip = None
        self.head_raylet = self.node_raylet = None
        self.node_dir, self.starts = None, 2
        self.used = {}  # (pid, start time) -> CPU seconds the cluster's process had used when last seen
        self.sampling = None

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    @property
    def job_address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard}"

    def __enter__(self):
        _adopt_orphans()
        import threading

        self.sampling = threading.Event()
        threading.Thread(target=self._sample_every, args=(1.0,), name="ray-cluster-cpu", daemon=True).start()
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def _ray_start(self, args: list[str], directory: str) -> None:
        """``ray start`` for a node whose temporary directory is ``directory``; started once more where its raylet
        died waiting for its dashboard agent's port file: Ray waits a fixed 15 s for it (ray#65983, open, no setting),
        which the agent, a Python process, missed while the CI legs beside it compiled (2026-12-01); and where the
        head's Ray Client server gave up waiting 30 s for the raylet (``_client_server_gave_up``). Any other failure
        raises with ray's own output and the raylet's last line."""
        for attempt in (1, 2):
            result = subprocess.run([RAY, "start", "--disable-usage-stats", "--num-gpus", "0", "--num-cpus",
                                     str(self.cpus), "--dashboard-agent-listen-port", str(free_port()), *args],
                                    env=self.env, capture_output=True, text=True, timeout=1200, cwd=self.cwd)
            if result.returncode == 0:
                return
            raylet = _raylet_failure(directory)
            if attempt == 2 or ("Timed out waiting for file" not in raylet and not _client_server_gave_up(directory)):
                raise RuntimeError(f"ray start {' '.join(args[:2])} exited {result.returncode}: "
                                   f"{(result.stdout + result.stderr)[-3000:]}\nraylet: {raylet}")
            self._kill(self._family(directory))

    def start(self) -> None:
        head = ["--head", "--port", str(self.port), "--temp-dir", self.temp, "--include-dashboard=true",
                "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard),
                "--ray-client-server-port", str(free_port())]
        if self.system_config:
            head += ["--system-config", json.dumps(self.system_config)]
        self._ray_start(head, self.temp)
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
        self._ray_start(["--address", self.address, "--temp-dir", self.node_dir], self.node_dir)
        self.node_raylet = next(p for p in self._raylets() if p.pid != self.head_raylet.pid)

    def _raylets(self) -> list[psutil.Process]:
        """This cluster's live raylets, oldest first. ``process_iter`` keeps the Process objects of earlier calls: one
        that ended since (a node killed by a test), or a dead raylet not yet reaped, is left out."""
        found = [p for p in psutil.process_iter(["name", "cmdline", "create_time", "status"])
                 if p.info.get("name") == "raylet" and p.info.get("create_time") is not None
                 and p.info.get("status") not in (None, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) and p.is_running()
                 and any(self.temp in a for a in (p.info.get("cmdline") or []))]
        return sorted(found, key=lambda p: p.info["create_time"])

    def kill_node(self) -> float:
        """The second node as a power loss would end it: its raylet, its log monitor and everything under them (its
        workers, agents), SIGKILL; returns when."""
        family = self._family(self.node_dir)
        when = time.time()
        self._kill(family)
        return when

    def submit(self, args: list[str], submission_id: str, env: dict | None = None) -> None:
        """``ray job submit --no-wait --submission-id ID --runtime-env-json {"env_vars": env} -- python ARGS``, as a
        user submits a job (the job runs where the head started)."""
        runtime = json.dumps({"env_vars": env or {}})
        subprocess.run([RAY, "job", "submit", "--address", self.job_address, "--submission-id", submission_id,
                        "--runtime-env-json", runtime, "--no-wait", "--", "python", *args], env=self.env, check=True,
                       capture_output=True, text=True, timeout=300)

    def _jobs(self):
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.job_address)

    def logs(self, submission_id: str) -> str:
        """What ``ray job logs ID`` prints."""
        return self._jobs().get_job_logs(submission_id)

    def status(self, submission_id: str) -> str:
        return str(self._jobs().get_job_status(submission_id)).split(".")[-1]

    def wait_job(self, submission_id: str, timeout: float) -> str:
        """The job's final status (SUCCEEDED, FAILED, STOPPED), waited for at most ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            status = self.status(submission_id)
            if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                return status
            time.sleep(1)
        log = self.logs(submission_id)[-4000:]
        raise TimeoutError(f"Ray job {submission_id} still running after {timeout} s:\n{log}")

    def wait_for_line(self, submission_id: str, text: str, timeout: float, after: int = 0) -> int:
        """Waits until the job's log holds ``text`` past character ``after``; returns where it ends."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            log = self.logs(submission_id)
            at = log.find(text, after)
            if at >= 0:
                return at + len(text)
            if self.status(submission_id) in ("SUCCEEDED", "FAILED", "STOPPED"):
                break
            time.sleep(0.5)
        raise AssertionError(f"{text!r} not in the log of Ray job {submission_id}:\n{self.logs(submission_id)[-4000:]}")

    def _family(self, directory: str) -> list[psutil.Process]:
        """The processes whose command line names ``directory``, and all under them."""
        family = {}
        for process in psutil.process_iter(["cmdline"]):
            if any(a.endswith(directory) or f"{directory}/" in a for a in (process.info["cmdline"] or [])):
                try:
                    for member in [process, *process.children(recursive=True)]:
                        family[member.pid] = member
                except psutil.NoSuchProcess:
                    continue
        return list(family.values())

    def _kill(self, family: list[psutil.Process]) -> None:
        """SIGKILL every process of ``family``, and wait until all are gone (``_end``)."""
        for process in family:
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self._end(family)

    def _end(self, family: list[psutil.Process], timeout: float = 10) -> None:
        """Wait until the processes of ``family`` (sent SIGKILL) are gone; reap those that are this process's
        children (``__enter__`` made it the parent of those whose parent ended)."""
        left, end = list(family), time.monotonic() + timeout
        while left and time.monotonic() < end:
            for process in list(left):
                try:
                    pid, _, _ = os.wait4(process.pid, os.WNOHANG)
                except ChildProcessError:  # another's child: gone once it no longer runs
                    try:
                        gone = process.status() == psutil.STATUS_ZOMBIE
                    except psutil.NoSuchProcess:
                        gone = True
                    if gone:
                        left.remove(process)
                    continue
                if pid:
                    left.remove(process)
            time.sleep(0.05)

    def _sample(self) -> None:
        for process in self._family(self.temp):
            try:
                times = process.cpu_times()
                self.used[(process.pid, process.create_time())] = times.user + times.system
            except psutil.NoSuchProcess:
                continue

    def _sample_every(self, seconds: float) -> None:
        while not self.sampling.wait(seconds):
            self._sample()

    def cpu_seconds(self) -> float:
        """CPU time the cluster's processes have used so far, as sampled every second (the raylet ignores its ended
        workers, so no parent counts their time): what a process used in its last second is missed."""
        self._sample()
        return sum(self.used.values())

    def stop(self) -> None:
        """Every process of the cluster (those whose command line names its directory, and all under them), by id."""
        if self.sampling is not None:
            self.sampling.set()
        self._kill(self._family(self.temp))
