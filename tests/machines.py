"""Machines simulated on this one: each a command (a pod's, a VM's, a node's) with its own environment, in its own
process group, its output read line by line and stamped with the time it was read. A machine can die as a real one
does (every process SIGKILLed at once). Used by tests/distributed/test_launchers.py and bench/elastic_recovery.py.

Nothing here imports ``trl_ext``.
"""

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from tests.harness import REPO, kill_tree

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# torchrun's agents share the round's TCP store with the ranks by default; then a restarted attempt's ranks read the
# previous attempt's addresses and hang setting up their process group (pytorch#135712), and a machine joining a
# running job waits for a store address the round's rank 0 never publishes again (pytorch#147064). Jobs that restart
# keep them apart (docs/launchers.md).
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class Machine:
    """One machine's command, started at once.

    Args:
        name: for messages.
        cmd: the command line.
        env: variables added to this process's environment.
        log: where its output goes (each line as read).
    """

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path):
        self.name, self.log, self.cmd, self.env = name, Path(log), cmd, env
        self.lines: list[tuple[float, str]] = []
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log, "ab") as log:
            for raw in iter(self.proc.stdout.readline, b""):
                log.write(raw)
                log.flush()
                for line in raw.decode(errors="replace").replace("\r", "\n").splitlines():
                    self.lines.append((time.time(), line))

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def when(self, pattern: str, timeout: float, after: float = 0.0) -> float:
        """The time the first line matching ``pattern`` (a regular expression) was read after ``after``; waits."""
        regex = re.compile(pattern)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for stamp, line in list(self.lines):
                if stamp >= after and regex.search(line):
                    return stamp
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise TimeoutError(f"{self.name}: no line matching {pattern!r} within {timeout} s:\n{self.output[-4000:]}")

    def wait(self, timeout: float) -> int:
        """Its exit code; a machine still running after ``timeout`` seconds is killed and the test fails."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.die()
            raise TimeoutError(f"{self.name} still ran after {timeout} s:\n{self.output[-4000:]}") from None
        self._reader.join(10)
        return self.proc.returncode

    def die(self) -> float:
        """Every process of the machine SIGKILLed at once, as when it loses power; the time it happened."""
        try:
            family = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        killed = time.time()
        for process in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        kill_tree(self.proc)
        return killed


def free_ports(count: int = 2) -> int:
    """The first of ``count`` consecutive TCP ports free here now: a job's port and trl_ext's meeting of machines on the
    next one (``launching.rendezvous``). A single free port's neighbour is often taken (an ephemeral port of another
    connection), and the meeting would then fail to listen.

    Returns:
        The first port.
    """
    import socket

    while True:
        with contextlib.ExitStack() as held:
            first = held.enter_context(socket.socket())
            first.bind(("", 0))
            base = first.getsockname()[1]
            try:
                for offset in range(1, count):
                    held.enter_context(socket.socket()).bind(("", base + offset))
            except (OSError, OverflowError):
                continue
            return base


def wait_for_port(port: int, timeout: float, machine: Machine) -> None:
    """Wait until something listens on ``port`` here (an elastic job's rendezvous: the machine whose agent started
    first hosts it, and must be the one that survives)."""
    import socket

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        if machine.proc.poll() is not None:
            break
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port} after {timeout} s:\n{machine.output[-3000:]}")


def wait_for_path(path: Path, timeout: float, machines: list[Machine] = ()) -> float:
    """The time ``path`` exists; waits (fails early, with their output, if every machine has ended)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            return time.time()
        if machines and all(m.proc.poll() is not None for m in machines):
            break
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not appear within {timeout} s:\n" +
                       "\n".join(f"--- {m.name}\n{m.output[-3000:]}" for m in machines))


def rank_process(launcher: int, rank: int):
    """The process of global rank ``rank`` among the processes under ``launcher`` (a process id), told by the
    environment torchrun gave it; None while there is none.

    Args:
        launcher: the process id of what started the ranks (a recipe that re-launched itself, torchrun).
        rank: the global rank.

    Returns:
        A ``psutil.Process``, or None.
    """
    import psutil

    try:
        children = psutil.Process(launcher).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for child in children:
        try:
            env = child.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if env.get("RANK") == str(rank) and env.get("LOCAL_RANK") is not None:
            return child
    return None
