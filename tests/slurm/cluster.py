"""A private Slurm cluster on this host for tests: munged, slurmctld and one slurmd per node, all started here.

Everything lives under one temporary directory (slurm.conf, munge key and socket, state, spool, logs, pid files), the
ports are picked free at start and the cluster name is unique, so the cluster neither needs nor disturbs a system
Slurm or munged. The "nodes" are slurmd daemons on 127.0.0.1 with their own ports (`slurmd -N n1`); their names do
not resolve as hosts, so a job script takes addresses from `NodeAddr` (`scontrol show node n1`).

Every call is bounded: client commands have timeouts, and every wait raises `SlurmError` with the job's record and
the daemons' log tails when it runs out. `stop()` removes the directory unless TRL_EXT_SLURM_KEEP is set (to read
the logs after a failure).
"""

from __future__ import annotations

import atexit
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

# Where Debian puts the daemons (/usr/sbin is not on every user's PATH).
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")

# Job states after which a job does not run again by itself (unless requeued by hand or by RequeueExit).
TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
     "PREEMPTED", "SPECIAL_EXIT"}
)
# Set in every daemon's and client's environment, so that teardown can find every process the cluster started
# (slurmstepd and job tasks outlive a killed slurmd) by reading /proc/*/environ.
MARKER_ENV = "TRL_EXT_SLURM_CLUSTER"
# Set in each slurmd's environment (and so its slurmstepd's): with the tasks' SLURMD_NODENAME, what one "node" runs.
NODE_ENV = "TRL_EXT_SLURM_TEST_NODE"

# `Key=Value Key=Value ...` as `scontrol show ... -o` prints it; values may hold `=` and `,` but keys start a token.
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][\w/:.]*)=(.*?)(?=\s+[A-Za-z][\w/:.]*=|\s*$)")


class SlurmError(RuntimeError):
    """A Slurm command failed or a wait ran out; the message carries the job's record and the daemons' logs."""


def missing_reason() -> str | None:
    """Why a cluster cannot be started here, in one line, or None when it can.

    Returns:
        `None` when the Slurm and munge programs are installed, else a one-line reason naming `.ci/slurm.sh`.
        Root is not needed once they are: every daemon runs as this user (`SlurmUser`, `SlurmdUser`), which is
        also the only user that submits jobs.
    """
    absent = [name for name in DAEMONS + CLIENTS if shutil.which(name, path=_SEARCH_PATH) is None]
    if absent:
        return (
            f"Slurm is not installed ({', '.join(absent)} not found): run .ci/slurm.sh as root, which installs "
            "the Debian packages slurmctld slurmd slurm-client munge"
        )
    return None


def parse_record(line: str) -> dict[str, str]:
    """Parses one `scontrol show job|node -o` line.

    Args:
        line: `Key=Value` pairs separated by spaces, as `scontrol ... -o` prints one record.

    Returns:
        The fields by key, values as strings (`JobState`, `Restarts`, `NodeList`, `StdOut`, `NodeAddr`, ...).
    """
    return {match.group(1): match.group(2) for match in _FIELD.finditer(line.strip())}


def _free_ports(count: int) -> list[int]:
    """Ports free now on every interface (held open together so that they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as error:
        return f"  ({error})"
    return "\n".join("  " + line for line in text[-lines:])


class SlurmCluster:
    """A private cluster of `nodes` slurmd daemons on 127.0.0.1, started by `start()` and stopped by `stop()`.

    Args:
        nodes: How many slurmd daemons ("nodes" `n1`, `n2`, ...) to start.
        cpus_per_node: CPUs each node declares. Every node shares this host's cores; `SlurmdParameters=
            config_overrides` makes slurmd accept more than the host has, so this may exceed `os.cpu_count()`.
        kill_wait: slurm.conf `KillWait`, seconds between SIGTERM and SIGKILL when a job is cancelled, requeued or
            runs out of time (Slurm's default is 30).
        cred_expire: `AuthInfo=cred_expire`, which is also how long a requeued job must wait before it may start
            again: it becomes eligible `cred_expire + 1` seconds after its processes have ended. Slurm's default is
            120; below 5 Slurm logs an error and uses 120, so this refuses it.
        sched_interval: `SchedulerParameters=sched_interval`: how often the main scheduler runs by itself, so how
            soon after it becomes eligible a requeued job starts (Slurm's default is 60).
        slurmd_timeout: `SlurmdTimeout`, seconds slurmctld waits for a slurmd that stopped answering before it marks
            the node DOWN (and requeues or ends the jobs on it); Slurm's default is 300.
        extra_conf: More slurm.conf lines (`RequeueExit=...`, say), appended last.
        root: Directory for all the cluster's files (made if missing and removed by `stop()` when it made it);
            a new temporary directory when None.
    """

    def __init__(
        self,
        nodes: int = 2,
        cpus_per_node: int = 2,
        kill_wait: int = 30,
        cred_expire: int = 5,
        sched_interval: int = 2,
        slurmd_timeout: int = 300,
        extra_conf: list[str] | None = None,
        root: str | Path | None = None,
    ):
        if cred_expire < 5:
            raise ValueError(f"cred_expire={cred_expire}: Slurm ignores values under 5 (and uses 120)")
        self.node_names = [f"n{i + 1}" for i in range(nodes)]
        self.cpus_per_node = cpus_per_node
        self.kill_wait = kill_wait
        self.cred_expire = cred_expire
        self.sched_interval = sched_interval
        self.slurmd_timeout = slurmd_timeout
        self.extra_conf = list(extra_conf or [])
        self._made_root = root is None
        # Under /tmp and world-searchable: munged wants every user able to reach its socket's directory.
        self.root = Path(tempfile.mkdtemp(prefix="trl-ext-slurm-") if root is None else root).resolve()
        self.name = "trlext" + uuid.uuid4().hex[:8]
        self.conf_path = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.jobs_dir = self.root / "jobs"
        self.env: dict[str, str] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        self._stdout: dict[str, str] = {}
        self._started = False

    # ----------------------------------------------------------------------------------------------- life cycle
    def start(self, timeout: float = 60) -> SlurmCluster:
        """Writes the configuration and starts munged, slurmctld and the slurmd daemons; returns once every node is
        idle.

        Args:
            timeout: Seconds allowed for each daemon to come up.

        Returns:
            This cluster, started.
        """
        reason = missing_reason()
        if reason:
            raise SlurmError(reason)
        atexit.register(self.stop)
        self._started = True
        try:
            self._write_config()
            self._start_munged(timeout)
            self._start_slurmctld(timeout)
            self._start_slurmds(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 20) -> None:
        """Cancels every job, stops every daemon and kills whatever they left (slurmstepd and job tasks).

        Args:
            timeout: Seconds allowed for the jobs to end and for each daemon to exit before SIGKILL.
        """
        if not self._started:
            return
        self._started = False
        atexit.unregister(self.stop)
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            try:
                # SIGKILL to the batch steps at once: a job that traps SIGTERM would hold teardown for KillWait.
                self._run(["scancel", "--full", "--signal=KILL", "--user", str(os.getuid())], check=False, timeout=10)
                self._run(["scancel", "--user", str(os.getuid())], check=False, timeout=10)
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline and self._run(["squeue", "-h", "-t", "R,CG"], check=False).stdout:
                    time.sleep(0.25)
            except SlurmError:
                pass  # whatever is left is killed below
        for name in sorted(self._procs, key=lambda name: name == "munged"):  # slurmds and slurmctld, then munged
            proc = self._procs[name]
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout)
        self._kill_leftovers()
        self._procs.clear()
        if self._made_root and not os.environ.get("TRL_EXT_SLURM_KEEP"):
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _kill_leftovers(self) -> None:
        """SIGKILLs every process carrying this cluster's marker (slurmstepd, job shells and tasks) but this one."""
        marker = f"{MARKER_ENV}={self.name}".encode()
        for _ in range(3):
            found = []
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit() or int(entry.name) == os.getpid():
                    continue
                try:
                    if marker in (entry / "environ").read_bytes().split(b"\0"):
                        found.append(int(entry.name))
                except OSError:
                    continue
            if not found:
                return
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.2)

    def kill_node(self, node: str) -> int:
        """Kills a node as a power loss would: its slurmd, slurmstepd daemons and every task running on it, with
        SIGKILL, all at once (slurmctld notices only when the node stops answering, `slurmd_timeout`).

        Args:
            node: The node name (`n2`).

        Returns:
            How many processes were killed.
        """
        proc = self._procs.pop(f"slurmd-{node}", None)
        killed = 0
        for pid in self._pids(f"{NODE_ENV}={node}".encode(), f"SLURMD_NODENAME={node}".encode()):
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        if proc is not None:
            proc.wait(10)
        return killed

    def revive_node(self, node: str, timeout: float = 60) -> None:
        """Starts a killed node's slurmd again and waits until slurmctld has it back in service (not DOWN).

        Args:
            node: The node name.
            timeout: Seconds allowed for the node to be back.
        """
        self._start_slurmd(node)

        def back() -> bool:
            state = self.node_info(node).get("State", "")
            return not any(flag in state for flag in ("DOWN", "NOT_RESPONDING"))

        self._wait(back, timeout, f"node {node} to be back in service")

    def retries_pending(self) -> int:
        """Messages slurmctld holds to send again (`sdiag`'s agent queue): those to a node that stopped answering
        before it was marked DOWN are sent when it answers again, and a kill for the job's earlier run then reaches
        its next one (same job and step ids). A test brings a killed node back only once this is 0.

        Returns:
            The number of queued messages.
        """
        for line in self._run(["sdiag"]).stdout.splitlines():
            if line.strip().startswith("Agent queue size:"):
                return int(line.split(":")[1])
        return 0

    def job_processes(self, job_id: str) -> list[int]:
        """The processes of a job on this cluster (its batch shell, srun, the tasks, and the step daemons,
        `slurmstepd: [<job>.<step>]`): while the job is pending, those of an earlier run still ending. A step that lost
        a node keeps signalling its step on it (`Job step aborted: Waiting up to 62 seconds`); once the node answers
        again, the signal reaches the next run's step of the same id. A test brings a killed node back only once
        these are gone.

        Args:
            job_id: The job id.

        Returns:
            Their process ids.
        """
        found = set(self._pids(f"SLURM_JOB_ID={job_id}".encode()))
        marker = f"{MARKER_ENV}={self.name}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
                env = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmdline.startswith(f"slurmstepd: [{job_id}.".encode()) and marker in env:
                found.add(int(entry.name))
        return sorted(found)

    def _pids(self, *any_of: bytes) -> list[int]:
        """This cluster's processes (but this one) whose environment holds any of ``any_of`` (``KEY=value``)."""
        marker, found = f"{MARKER_ENV}={self.name}".encode(), []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in env and any(item in env for item in any_of):
                found.append(int(entry.name))
        return found

    def _write_config(self) -> None:
        for sub in ("munge", "state", "log", "run", "jobs", *(f"spool/{n}" for n in self.node_names)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        os.chmod(self.root / "munge", 0o755)
        ctld_port, *node_ports = _free_ports(1 + len(self.node_names))
        user = _user_name()
        host = socket.gethostname().split(".")[0]  # slurmctld checks that it runs on SlurmctldHost
        lines = [
            f"ClusterName={self.name}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool' / '%n'}",
            f"SlurmctldPidFile={self.root / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd-%n.log'}",
            "SlurmctldDebug=debug",
            "SlurmdDebug=debug",
            # No cgroups in a container: track processes by parentage, bind nothing.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            # Nodes are believed as declared (every node shares this host's cores).
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            f"KillWait={self.kill_wait}",
            f"SlurmdTimeout={self.slurmd_timeout}",
            # Replies may be slow on this loaded host: an RPC unanswered within MessageTimeout is sent again later,
            # and a signal for a job's step then reaches the step of the job's next run (same ids) and kills it.
            "MessageTimeout=30",
            # Keep finished jobs visible to `scontrol show job` for the whole session: there is no slurmdbd/sacct.
            "MinJobAge=86400",
            f"SchedulerParameters=sched_interval={self.sched_interval},bf_interval=1",
            *(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus_per_node} "
                "State=UNKNOWN"
                for node, port in zip(self.node_names, node_ports)
            ),
            f"PartitionName=debug Nodes={','.join(self.node_names)} Default=YES MaxTime=INFINITE State=UP",
            *self.extra_conf,
        ]
        self.conf_path.write_text("\n".join(lines) + "\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        env.update({"SLURM_CONF": str(self.conf_path), MARKER_ENV: self.name, "PATH": _SEARCH_PATH})
        self.env = env

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.root / "log" / f"{name}.stdout", "ab")
        try:
            proc = subprocess.Popen(
                argv, env={**self.env, **(env or {})}, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=self.root, preexec_fn=_die_with_parent,
            )
        finally:
            log.close()
        self._procs[name] = proc
        return proc

    def _start_munged(self, timeout: float) -> None:
        key = self.root / "munge" / "munge.key"
        subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True,
                       timeout=30)
        self._spawn("munged", [
            _which("munged"), "--foreground", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={self.root / 'run' / 'munged.pid'}", f"--seed-file={self.root / 'munge' / 'munged.seed'}",
            f"--log-file={self.root / 'log' / 'munged.log'}",
        ])
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged to create its socket")

    def _start_slurmctld(self, timeout: float) -> None:
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf_path)])
        self._wait(lambda: "is UP" in self._run(["scontrol", "ping"], check=False).stdout, timeout,
                   "slurmctld to answer `scontrol ping`")

    def _start_slurmd(self, node: str) -> None:
        self._spawn(f"slurmd-{node}", [_which("slurmd"), "-D", "-N", node, "-f", str(self.conf_path)],
                    env={NODE_ENV: node})

    def _start_slurmds(self, timeout: float) -> None:
        for node in self.node_names:
            self._start_slurmd(node)

        def all_idle() -> bool:
            states = self._run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout.split("\n")
            return sum(line.split()[1:] == ["idle"] for line in states if line.strip()) == len(self.node_names)

        self._wait(all_idle, timeout, "every node to be idle")

    # ----------------------------------------------------------------------------------------------- commands
    def _run(self, argv: list[str], check: bool = True, timeout: float = 30, env: dict[str, str] | None = None,
             **kwargs) -> subprocess.CompletedProcess:
        try:
            result = subprocess.run(argv, env=env or self.env, capture_output=True, text=True, timeout=timeout,
                                    **kwargs)
        except subprocess.TimeoutExpired as error:
            raise SlurmError(f"`{shlex.join(argv)}` ran past {timeout}s\n{self.logs()}") from error
        if check and result.returncode != 0:
            raise SlurmError(
                f"`{shlex.join(argv)}` exited {result.returncode}: {result.stderr.strip()}\n{self.logs()}"
            )
        return result

    def run(self, argv: list[str], timeout: float = 30, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """Runs a command (a Slurm client, say) against this cluster, with its output captured as text.

        Args:
            argv: The command and its arguments.
            timeout: Seconds before `SlurmError`.
            check: Raise `SlurmError` when it exits non-zero.
            **kwargs: More `subprocess.run` arguments (`cwd`, `input`).

        Returns:
            The finished process.
        """
        return self._run(argv, check=check, timeout=timeout, **kwargs)

    def sbatch(self, args: list[str], script: str | Path, cwd: str | Path | None = None, name: str = "job",
               script_args: list[str] = (), env: dict[str, str] | None = None) -> str:
        """Submits a batch script.

        Args:
            args: sbatch options (`-N2`, `--ntasks-per-node=1`, `--requeue`, `--signal=B:USR1@60`, ...); unless
                they set `--output`/`-o`, the job writes to `<root>/jobs/<name>-<job id>.out`. A requeued job's
                next run truncates that file unless they include `--open-mode=append`.
            script: The script's text, `#!/bin/bash` line included, or the path of a script file to submit as it is.
            cwd: Directory to submit from (the job's working directory and `SLURM_SUBMIT_DIR`); the jobs directory
                when None.
            name: A name for the script file and the default output file.
            script_args: Arguments for the script, after its path (`sbatch [options] script ARGS`).
            env: Variables added to the job's environment (sbatch hands its own environment to the job).

        Returns:
            The job id.
        """
        if isinstance(script, Path):
            path = script
        else:
            path = self.jobs_dir / f"{name}-{uuid.uuid4().hex[:6]}.sh"
            path.write_text(script)
            path.chmod(0o755)
        options = list(args)
        if not any(a == "-o" or a.startswith(("-o", "--output")) for a in options):
            options.append(f"--output={self.jobs_dir / name}-%j.out")
        result = self._run(["sbatch", "--parsable", *options, str(path), *script_args], cwd=cwd or self.jobs_dir,
                           env={**self.env, **(env or {})})
        job_id = result.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise SlurmError(f"sbatch printed no job id: {result.stdout!r} {result.stderr!r}")
        return job_id

    def job_info(self, job_id: str) -> dict[str, str]:
        """The job's record from slurmctld (there is no slurmdbd, so no sacct).

        Args:
            job_id: The job id.

        Returns:
            `scontrol show job -o` as a dict: `JobState`, `Reason`, `Restarts`, `ExitCode` (`"code:signal"`),
            `NodeList`, `BatchHost`, `StartTime`, `StdOut`, ...
        """
        line = self._run(["scontrol", "show", "job", "-o", str(job_id)]).stdout.strip().splitlines()
        if not line:
            raise SlurmError(f"no record of job {job_id}")
        info = parse_record(line[0])
        if "StdOut" in info:
            self._stdout[str(job_id)] = info["StdOut"]
        return info

    def node_info(self, node: str) -> dict[str, str]:
        """The node's record (`NodeAddr`, `State`, `CPUTot`, ...) from `scontrol show node -o`.

        Args:
            node: The node name (`n1`).

        Returns:
            The fields by key.
        """
        return parse_record(self._run(["scontrol", "show", "node", "-o", node]).stdout)

    def wait_state(self, job_id: str, states, timeout: float = 60, min_restarts: int = 0,
                   count_pending: bool = True, output: Path | None = None) -> dict[str, str]:
        """Waits until the job is in one of `states` (and has been restarted at least `min_restarts` times).

        Args:
            job_id: The job id.
            states: A state or states (`"RUNNING"`, `{"COMPLETED", "FAILED"}`); see `TERMINAL_STATES`.
            timeout: Seconds before `SlurmError`.
            min_restarts: Least `Restarts` count (1 to wait for the run after a requeue, not the one before).
            count_pending: Whether the time the job spends PENDING counts towards `timeout`. False for a wait on
                the job's own work: how long it queues depends on the jobs before it (the test's own timeout still
                bounds the whole).
            output: The job's log: then only the seconds it has not grown count (see `wait_until`).

        Returns:
            The job's record once it is there.

        Raises:
            SlurmError: At the timeout, or at once when the job ends in another terminal state; the message has the
                job's record, its output so far and the daemons' log tails.
        """
        wanted = {states} if isinstance(states, str) else set(states)

        def there(info: dict[str, str]) -> bool:
            return info.get("JobState") in wanted and int(info.get("Restarts", "0") or 0) >= min_restarts

        def ended(info: dict[str, str]) -> bool:  # (a state before the restarts asked for may still requeue)
            return info.get("JobState") in TERMINAL_STATES and int(info.get("Restarts", "0") or 0) >= min_restarts

        return self.wait_until(job_id, there, ended, timeout, f"{sorted(wanted)} with restarts >= {min_restarts}",
                               count_pending, output=output)

    def wait_until(self, job_id: str, done, ended, timeout: float, what: str, count_pending: bool = True,
                   poll: float = 0.2, output: Path | None = None) -> dict[str, str]:
        """Polls the job's record until ``done(record)``: the one waiting loop of the Slurm tests.

        Args:
            job_id: The job id.
            done: What is waited for, given the job's record.
            ended: Whether the job has ended without it, given the record (then the wait fails at once).
            timeout: Seconds before `SlurmError`.
            what: What is waited for, for the message.
            count_pending: Whether the time the job spends PENDING counts towards `timeout` (see `wait_state`).
            poll: Seconds between looks.
            output: The job's log. Given, ``timeout`` bounds the seconds since it last grew: a hang's bound, not a
                run's. A job that prints as it goes is not hung however slowly it runs (the early jobs share the
                nodes' cores with each other and with CI's other legs: the reference run printed its last step 110 s
                into training and was still saving at 400 s, 2026-12-03); the test's own timeout bounds the whole.

        Returns:
            The job's record once ``done``.

        Raises:
            SlurmError: At the timeout, or when the job has ended; the message has the job's record, its output so
                far and the daemons' log tails.
        """
        clock = RunClock(self, job_id, count_pending, output)
        while True:
            info = clock.tick()
            if done(info):
                return info
            state = f"{info.get('JobState', '')} (restarts {info.get('Restarts', '0')})"
            if ended(info):
                raise SlurmError(self.describe(job_id, f"job {job_id} ended {state}, waiting for {what}"))
            if clock.seconds > timeout:
                raise SlurmError(self.describe(job_id, f"job {job_id} still {state} after {timeout}s"
                                                       f"{'' if count_pending else ' out of the queue'}"
                                                       f"{'' if output is None else ' with its log unchanged'}, "
                                                       f"waiting for {what}"))
            time.sleep(poll)

    def wait_done(self, job_id: str, timeout: float = 60) -> dict[str, str]:
        """Waits until the job has ended in any terminal state.

        Args:
            job_id: The job id.
            timeout: Seconds before `SlurmError`.

        Returns:
            The job's record (`JobState`, `ExitCode`, ...).
        """
        return self.wait_state(job_id, TERMINAL_STATES, timeout)

    def wait_output(self, job_id: str, text: str, timeout: float = 60) -> str:
        """Waits until the job's output file contains `text` (a line a script prints once it is ready, say).

        Args:
            job_id: The job id.
            text: What to wait for.
            timeout: Seconds before `SlurmError`.

        Returns:
            The output so far.
        """
        deadline = time.monotonic() + timeout
        while True:
            out = self.output(job_id)
            if text in out:
                return out
            if time.monotonic() > deadline:
                raise SlurmError(self.describe(job_id, f"job {job_id} did not print {text!r} in {timeout}s"))
            time.sleep(0.2)

    def requeue(self, job_id: str, hold: bool = False) -> None:
        """`scontrol requeue` (or `requeuehold`): the batch shell, its children and every step's tasks get SIGCONT and
        SIGTERM, then SIGKILL after `KillWait`; the job goes back to PENDING with the same id and `Restarts` + 1, and
        may start again `cred_expire + 1` seconds after its processes ended (sooner with `start_now`).

        Args:
            job_id: The job id.
            hold: Keep it held once pending, until `release`.
        """
        self._run(["scontrol", "requeuehold" if hold else "requeue", str(job_id)])

    def start_now(self, job_id: str, timeout: float = 60) -> dict[str, str]:
        """Makes a requeued job eligible now instead of `cred_expire + 1` seconds after its requeue ended.

        Waits until the job is back to PENDING first: while it is still COMPLETING (its processes have up to
        `KillWait` to exit), `scontrol update StartTime=now` is accepted but then overwritten when the requeue
        completes. Then waits for the next whole second (see below) and updates; slurmctld schedules at once.

        Args:
            job_id: The job id.
            timeout: Seconds allowed for the job to be pending.

        Returns:
            The job's record when it was found pending (or running again).
        """
        info = self.wait_state(job_id, {"PENDING", "RUNNING"}, timeout)
        if info["JobState"] == "PENDING":  # (RUNNING: it has started again already)
            # slurmd revoked the job's credential when the requeue killed it, and refuses a new one stamped in the
            # same second ("Killing non-startable batch job: Job credential revoked", the job then FAILED with
            # exit 1): that is why Slurm waits cred_expire + 1 s. Starting in the next whole second is enough.
            time.sleep(1.05 - time.time() % 1)
            self._run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
        return info

    def release(self, job_id: str) -> None:
        """Releases a held job (after `requeue(hold=True)` or `RequeueExitHold`).

        Args:
            job_id: The job id.
        """
        self._run(["scontrol", "release", str(job_id)])

    def cancel(self, job_id: str, *options: str) -> None:
        """`scancel` with options (`--signal=USR1`, `--batch`, `--full`).

        Args:
            job_id: The job id.
            *options: scancel options.
        """
        self._run(["scancel", *options, str(job_id)])

    def output(self, job_id: str) -> str:
        """The job's standard output so far ("" before it exists).

        Args:
            job_id: The job id.

        Returns:
            The text of its `StdOut` file.
        """
        path = self._stdout.get(str(job_id)) or self.job_info(job_id).get("StdOut", "")
        try:
            return Path(path).read_text(errors="replace")
        except OSError:
            return ""

    # ----------------------------------------------------------------------------------------------- diagnostics
    def logs(self, lines: int = 25) -> str:
        """The last lines of every daemon's log, for failure messages.

        Args:
            lines: Lines per log.

        Returns:
            The tails, each under a header naming the log.
        """
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            if path.stat().st_size:
                parts.append(f"--- {path}\n{_tail(path, lines)}")
        return "\n".join(parts)

    def describe(self, job_id: str, message: str) -> str:
        """`message`, the job's record, the end of its output and the daemons' log tails: what a failure says.

        Args:
            job_id: The job id.
            message: What went wrong.

        Returns:
            The text.
        """
        try:
            info = " ".join(f"{k}={v}" for k, v in self.job_info(job_id).items())
        except SlurmError as error:
            info = str(error).splitlines()[0]
        out = self.output(job_id)[-3000:]
        return f"{message}\n--- job {job_id}: {info}\n--- output:\n{out}\n{self.logs()}"

    def _wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            dead = [name for name, proc in self._procs.items() if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"no luck in {timeout}s"
                raise SlurmError(f"waiting for {what}: {why}\n{self.logs()}")
            time.sleep(0.2)


class RunClock:
    """The seconds a wait has lasted, or only those the job spent out of the queue (not PENDING), or only those since
    its log last grew.

    Args:
        cluster: The cluster.
        job_id: The job id.
        count_pending: Whether time PENDING counts too (then this is the wait's wall time).
        output: The job's log: each tick that finds it grown starts the count again.
    """

    def __init__(self, cluster: SlurmCluster, job_id: str, count_pending: bool = True, output: Path | None = None):
        self.cluster, self.job_id, self.count_pending, self.output = cluster, job_id, count_pending, output
        self.seconds = 0.0
        self._last = time.monotonic()
        self._pending = False
        self._size = -1

    def tick(self) -> dict[str, str]:
        """Adds the time since the last tick (unless the job was pending then) and returns the job's record."""
        now = time.monotonic()
        if self.count_pending or not self._pending:
            self.seconds += now - self._last
        self._last = now
        if self.output is not None:
            size = self.output.stat().st_size if self.output.exists() else -1
            if size != self._size:
                self._size, self.seconds = size, 0.0
        info = self.cluster.job_info(self.job_id)
        self._pending = info.get("JobState") == "PENDING"
        return info


def _which(name: str) -> str:
    path = shutil.which(name, path=_SEARCH_PATH)
    if path is None:
        raise SlurmError(missing_reason() or f"{name} not found")
    return path


def _die_with_parent() -> None:
    """In a daemon before exec: SIGTERM it when the process that started the cluster dies (a test run killed with
    SIGKILL then leaves no daemons behind; job processes it had running still need `stop()`)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _user_name() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name
