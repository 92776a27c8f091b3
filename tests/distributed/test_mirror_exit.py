"""Issue 62's exit paths, end to end: a user's own script with a checkpoint mirror (``tests/scripts/mirror_exit.py``,
which never waits for the mirror) against a real S3 server (``rclone serve s3``) reached through a proxy of our own
(``tests/s3_proxy.py``) that slows the uploads, so that they are still in flight or queued when the script returns,
and, for one path, stops answering once the script returns. In 1 process (plain ``python``) and in 2 processes under
ZeRO-3 (``accelerate launch``), five paths:

- ``save_model``: returns right after ``save_model()`` (the issue's script);
- ``train``: returns right after ``train()``, checkpoint-4's upload still queued;
- ``raise``: raises right after ``save_model()`` (under torchrun, rank 1's failure makes the launcher send SIGTERM to
  rank 0 while it finishes the uploads at exit, and SIGKILL 30 s later: the uploads get ``mirror_grace_period``);
- ``sigterm``: SIGTERM to every rank while checkpoint-2 uploads: a preemption, checkpoint-3 saved and uploaded within
  ``mirror_grace_period``;
- ``stalled``: the store stops answering when the script returns: the process ends after
  ``mirror_exit_grace_period``, saying in one line what stayed only local, kept in the outbox.

Each must end within its bound with the right exit code, and the mirror must hold what was committed, the final model
included, file for file. The 10 launches are independent and start together (one module fixture); each test reads
its own.
"""

import json
import os
import re
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import SCRIPTS, Launch, accelerate_launch, run_command, write_accelerate_config
from tests.s3_proxy import S3Proxy
from tests.s3_server import S3Server
from trl_ext.files import manifest
from trl_ext.mirror.outbox import DIR as OUTBOX
from trl_ext.mirror.uploader import EXIT_JOIN_SECONDS

pytestmark = pytest.mark.slow

LAYOUTS = ["1-process", "zero3"]
RATE = 1_000_000  # bytes/s through the proxy: a checkpoint (1.4 MiB; 2.0 MiB under ZeRO-3) takes 1.5-2 s to upload
# raise: slower, so that under torchrun the uploads (4.5 MiB, 11 s) are still going when the launcher, seeing rank 1
# failed, sends SIGTERM to rank 0 (1 to 10 s after it)
RAISE_RATE = 400_000
LAST_LINE_TO_EXIT_S = 60.0  # the bound, with a store that answers
EXIT_GRACE_S = 10.0  # mirror_exit_grace_period of the stalled path
MIRROR_GRACE_S = 60.0  # mirror_grace_period of the SIGTERM path: ample for checkpoints 2 and 3 at RATE
# beyond a grace period: the interpreter's teardown and, under accelerate launch, the launcher's own end, on a loaded
# 2-core machine
MARGIN_S = 30.0
LAUNCH_TIMEOUT_S = 400  # the hang detector

# path: the script's --mode, its extra config, the proxy's rate
PATHS = {
    "save_model": ("save_model", {}, RATE),
    "train": ("train", {}, RATE),
    "raise": ("raise", {}, RAISE_RATE),
    "sigterm": ("train", {"mirror_grace_period": MIRROR_GRACE_S}, RATE),
    "stalled": ("save_model", {"mirror_exit_grace_period": EXIT_GRACE_S}, RATE),
}


@dataclass
class Exit:
    launch: Launch
    ended: float  # time.time() when the launch had ended
    out: Path
    url: str
    signalled: float | None = None  # when SIGTERM was sent (the sigterm path)

    @property
    def output(self) -> str:
        return self.launch.output

    def after_last_line(self) -> float:
        """Seconds from the script's last line (the first rank's) to the end of the process (or launch)."""
        ends = [float(t) for t in re.findall(r"^SCRIPT END rank \d+ at ([\d.]+)$", self.output, re.M)]
        assert ends, f"the script never reached its last line:\n{self.output[-4000:]}"
        return self.ended - min(ends)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with S3Server(tmp_path_factory.mktemp("s3")) as server:
        yield server


def _sigterm_during_upload(tmp: Path, out: Path, ranks: int, ended: threading.Event, times: dict) -> threading.Thread:
    """Once checkpoint-2 is in the outbox (its upload starts) and every rank has written its pid: SIGTERM to every
    rank, then the file the ranks wait for before step 3 (so the signal comes while training runs)."""

    def run():
        pids = tmp / "pids"
        while not ((out / OUTBOX / "checkpoint-2").exists() and len(list(pids.glob("rank*.pid"))) == ranks):
            if ended.wait(0.02):
                return
        times["signalled"] = time.time()
        for pid_file in pids.glob("rank*.pid"):
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        (tmp / "go").write_text("signalled")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _run(s3: S3Server, root: Path, zero3: Path, layout: str, path: str) -> Exit:
    mode, config, rate = PATHS[path]
    tmp = root / f"{layout}-{path}"
    tmp.mkdir(parents=True)
    out, url = tmp / "out", f"s3://{s3.bucket()}/run"
    args = ["--mode", mode, "--output_dir", str(out), "--mirror", url, "--pids", str(tmp / "pids"),
            "--config_json", json.dumps(config)]
    if path == "stalled":
        args += ["--marker", str(tmp / "returning")]
    if path == "sigterm":
        args += ["--wait_for", str(tmp / "go"), "--wait_at_step", "3"]
    ranks = 1 if layout == "1-process" else 2
    ended, times = threading.Event(), {}
    with S3Proxy(s3.port, rate=rate, stall_when=tmp / "returning" if path == "stalled" else None) as proxy:
        watcher = _sigterm_during_upload(tmp, out, ranks, ended, times) if path == "sigterm" else None
        env = proxy.env(s3.env)
        if layout == "1-process":
            launch = run_command([sys.executable, str(SCRIPTS / "mirror_exit.py"), *args], LAUNCH_TIMEOUT_S, env)
        else:
            launch = accelerate_launch(SCRIPTS / "mirror_exit.py", args, zero3, LAUNCH_TIMEOUT_S, env)
        done = time.time()
        ended.set()
        if watcher is not None:
            watcher.join(10)
    (tmp / "launch.log").write_text(launch.output)
    return Exit(launch, done, out, url, times.get("signalled"))


@pytest.fixture(scope="module")
def exits(s3, tmp_path_factory):
    """Every (layout, path) launched at once (2-process launches first: they take longest); their ``Exit``s."""
    root = tmp_path_factory.mktemp("mirror-exit")
    zero3 = write_accelerate_config(root / "configs", "zero3")  # once: it builds DeepSpeed's op on first use
    cases = [(layout, path) for layout in reversed(LAYOUTS) for path in PATHS]
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = {case: pool.submit(_run, s3, root, zero3, *case) for case in cases}
    runs = {case: future.result() for case, future in futures.items()}
    for (layout, path), run in runs.items():  # measured, for the record (pytest -rP shows them)
        ends = re.findall(r"^SCRIPT END rank \d+ at ([\d.]+)$", run.output, re.M)
        since = (f"{run.ended - min(map(float, ends)):.1f} s after the last line" if ends else
                 f"{run.ended - run.signalled:.1f} s after SIGTERM" if run.signalled else "no last line")
        print(f"{layout} {path}: exit {run.launch.returncode}, {since}")
    return runs


def _store(s3: S3Server, url: str):
    from trl_ext.mirror.store import Store

    os.environ.update(s3.env)  # the conftest restores the environment after each test
    return Store(url)


def _local_manifest(files: list[Path], root: Path) -> dict:
    found = {}
    for path in sorted(files):
        digest = manifest.hasher()
        digest.update(path.read_bytes())
        found[str(path.relative_to(root))] = {"size": path.stat().st_size, manifest.ALGORITHM: digest.hexdigest()}
    return found


def _model_files(out: Path) -> list[Path]:
    """What ``save_model()`` mirrors: the regular files at the top of ``output_dir``."""
    return [p for p in out.iterdir() if p.is_file() and not p.name.startswith(".")]


def _mirrored(s3: S3Server, run: Exit) -> set[str]:
    """What the mirror holds complete (``checkpoint-N``, ``model``), each checked file for file against what was
    committed locally."""
    store = _store(s3, run.url)
    held = set()
    for step in store.complete():
        local = run.out / f"checkpoint-{step}"
        assert store.read_manifest(f"checkpoint-{step}").files == _local_manifest(
            [p for p in local.rglob("*") if p.is_file()], local), step
        held.add(f"checkpoint-{step}")
    try:
        model = store.read_manifest("")
    except FileNotFoundError:
        return held
    assert model.files == _local_manifest(_model_files(run.out), run.out)
    return held | {"model"}


def _assert_ended(run: Exit, layout: str, code: int) -> None:
    """Not timed out, with ``code`` (plain python), or under torchrun its own 1 (a rank failed) with ``code`` as the
    root cause, the other rank's code ``code`` or -15 (the launcher's SIGTERM once one rank has exited)."""
    assert not run.launch.timed_out, f"the process did not end within {LAUNCH_TIMEOUT_S} s:\n{run.output[-4000:]}"
    assert "cannot schedule new futures" not in run.output and "error of trl_ext's own" not in run.output
    if layout == "1-process" or code == 0:
        assert run.launch.returncode == code, run.output[-4000:]
        return
    assert run.launch.returncode == 1, run.output[-4000:]  # torchrun's own code for a failed worker
    root_cause = run.output.split("Root Cause")[-1]
    assert re.search(rf"exitcode\s*: {code}\b", root_cause), run.output[-4000:]
    codes = re.findall(r"exitcode\s*: (-?\d+)", run.output)
    assert codes and set(codes) <= {str(code), "-15"}, run.output[-4000:]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_script_that_returns_after_save_model_ends_within_60_s_and_the_mirror_holds_everything(exits, s3, layout):
    """The issue's Done-when: exit 0 within 60 s of the last line; checkpoint-2, checkpoint-4 and the final model in
    the mirror."""
    run = exits[layout, "save_model"]
    _assert_ended(run, layout, 0)
    assert run.after_last_line() < LAST_LINE_TO_EXIT_S, run.after_last_line()
    assert _mirrored(s3, run) == {"checkpoint-2", "checkpoint-4", "model"}
    assert "mirror: the model complete at" in run.output
    assert not any((run.out / OUTBOX).iterdir())  # nothing left in the outbox


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_script_that_returns_after_train_finishes_the_queued_uploads_then_ends(exits, s3, layout):
    run = exits[layout, "train"]
    _assert_ended(run, layout, 0)
    assert run.after_last_line() < LAST_LINE_TO_EXIT_S, run.after_last_line()
    finishing = [line for line in run.output.splitlines() if "checkpoint_mirror: finishing the upload of" in line]
    assert len(finishing) == 1 and "checkpoint-4" in finishing[0], finishing  # still queued when the script returned
    assert _mirrored(s3, run) == {"checkpoint-2", "checkpoint-4"}
    assert not any((run.out / OUTBOX).iterdir())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_script_that_raises_ends_with_its_error_and_the_mirror_holds_everything(exits, s3, layout):
    """Under torchrun the failed rank 1 makes the launcher send SIGTERM to rank 0 while it finishes the uploads at
    exit: rank 0 finishes them within mirror_grace_period first (before the launcher's SIGKILL, 30 s later)."""
    run = exits[layout, "raise"]
    _assert_ended(run, layout, 1)
    assert "RuntimeError: the user's script failed after training" in run.output
    assert run.after_last_line() < LAST_LINE_TO_EXIT_S, run.after_last_line()
    assert _mirrored(s3, run) == {"checkpoint-2", "checkpoint-4", "model"}
    assert not any((run.out / OUTBOX).iterdir())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sigterm_during_an_upload_stops_with_a_checkpoint_that_reaches_the_mirror(exits, s3, layout):
    run = exits[layout, "sigterm"]
    assert run.signalled is not None, f"checkpoint-2 never reached the outbox:\n{run.output[-4000:]}"
    _assert_ended(run, layout, 143)
    # the signal comes as checkpoint-2 is committed: the stop is there (the save's own check), or at step 3
    stop = re.search(rf"SIGTERM received: saved {re.escape(str(run.out))}/checkpoint-([23]) \(step \1\) and "
                     "stopped, exit code 143", run.output)
    assert stop, run.output[-4000:]
    assert f"every committed checkpoint is in {run.url} (within the {MIRROR_GRACE_S:.0f} s grace period)" in run.output
    seconds = run.ended - run.signalled
    assert seconds < MIRROR_GRACE_S + MARGIN_S, seconds
    # the stopping checkpoint included, with the one whose upload the signal interrupted
    assert _mirrored(s3, run) == {f"checkpoint-{step}" for step in range(2, int(stop.group(1)) + 1)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_store_that_stops_answering_at_exit_ends_the_process_after_the_grace_period_saying_what_is_local(
        exits, s3, layout):
    run = exits[layout, "stalled"]
    _assert_ended(run, layout, 0)
    seconds = run.after_last_line()
    assert EXIT_GRACE_S <= seconds < EXIT_GRACE_S + EXIT_JOIN_SECONDS + MARGIN_S, seconds
    lines = [line for line in run.output.splitlines() if "only local" in line]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "checkpoint_mirror: exiting with " in line and f"the {EXIT_GRACE_S:.0f} s mirror_exit_grace_period ran " \
        f"out" in line and f"They are kept in {run.out / OUTBOX}: the next run with this output_dir uploads" in line
    # every committed checkpoint and the model: in the mirror, or named in the line and kept in the outbox
    held = _mirrored(s3, run)
    named = {"model" if name == "the model" else name
             for name in line.split("exiting with ")[1].split(" only local")[0].split(", ")}
    assert "model" in named  # queued behind checkpoint-4 at RATE: never done before the store stopped answering
    # (one can be both: its manifest reached the store, and the answer never came back; the next run finds it complete)
    assert held | named == {"checkpoint-2", "checkpoint-4", "model"}, (held, named)
    for name in named:
        assert (run.out / OUTBOX / name / "job.json").is_file(), name
