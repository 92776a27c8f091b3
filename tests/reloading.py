"""Reloads of saved checkpoints with plain transformers + peft, in one process per test session that never imports
trl_ext, TRL or DeepSpeed (``tests/scripts/reload.py --serve``): it starts on the first request, and its start-up,
which costs more than the reloads, is paid once rather than once per test."""

import atexit
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time

from tests.harness import REPO, SCRIPTS, kill_tree

_server: subprocess.Popen | None = None
_lines: queue.Queue = queue.Queue()  # the process's stdout, read by a thread (None once it ends)
_stderr = None


def reload(base: str, kind: str, checkpoints: list, timeout: float = 300) -> dict:
    """Each checkpoint's probe outputs and metadata differences, as ``tests/scripts/reload.py`` prints them.

    Args:
        base: the base model an adapter is loaded on.
        kind: "causal", "reward" or "reward-autopeft".
        checkpoints: the saved directories, loaded in this order.
        timeout: seconds for the whole request; past them the process is killed (the next request starts another).

    Returns:
        ``{"outputs": {checkpoint: outputs}, "metadata": {checkpoint: [difference, ...]}}``, keyed by ``str(path)``.

    Raises:
        AssertionError: a reload failed (with its traceback), or the process ended or timed out.
    """
    server = _start()
    request = {"base": str(base), "kind": kind, "checkpoints": [str(c) for c in checkpoints]}
    server.stdin.write(json.dumps(request) + "\n")
    server.stdin.flush()
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = _lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = ""
        if not line:  # timed out (""), or the process ended (None)
            _stop()
            raise AssertionError(f"reload process {'ended' if line is None else 'timed out'}: {_stderr_tail()}")
        if line.startswith("RELOAD "):
            answer = json.loads(line.removeprefix("RELOAD "))
            assert "error" not in answer, answer.get("error")
            return answer


def _start() -> subprocess.Popen:
    global _server, _lines, _stderr
    if _server is None or _server.poll() is not None:
        _stderr, _lines = tempfile.TemporaryFile(mode="w+"), queue.Queue()
        _server = subprocess.Popen([sys.executable, str(SCRIPTS / "reload.py"), "--serve"], cwd=REPO, text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=_stderr,
                                   start_new_session=True)
        threading.Thread(target=_read, args=(_server.stdout, _lines), daemon=True).start()
    return _server


def _read(stdout, lines: queue.Queue) -> None:
    for line in stdout:
        lines.put(line)
    lines.put(None)


def _stderr_tail() -> str:
    if _stderr is None:
        return ""
    _stderr.seek(0)
    return _stderr.read()[-4000:]


@atexit.register
def _stop() -> None:
    global _server
    if _server is not None:
        kill_tree(_server)
        _server = None
