"""The README's main-job command, run exactly as written (CI installs and tests with the README's commands too)."""

import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.harness import REPO, run_command


def readme_command(marker: str) -> str:
    """The first line of the ```bash block under ``<!-- marker -->`` (what .ci/run reads for the test command)."""
    text = (REPO / "README.md").read_text()
    block = re.search(rf"<!-- {marker} -->\s*```bash\n(.+?)\n", text)
    assert block, f"README has no command under <!-- {marker} -->"
    return block.group(1)


def test_readme_commands_use_the_readme_venv():
    for marker in ("main-command", "test-command"):
        assert readme_command(marker).startswith("python3 -m venv .venv && . .venv/bin/activate && pip install ")
    # lint, then the newest combination in full with the oldest supported one (docs/versions.md) and a real Slurm
    # beside it
    assert readme_command("test-command").endswith("&& ruff check . && .ci/test.sh")


@pytest.mark.slow
def test_readme_main_command(tmp_path):
    if Path(sys.prefix).resolve() != (REPO / ".venv").resolve():
        pytest.skip("the main command sets up and uses REPO/.venv; this suite runs from another environment")
    command = readme_command("main-command")
    # the form that launches itself (tests/test_recipes.py runs the `accelerate launch` form)
    assert command.endswith("&& python recipes/dpo.py --config accelerate_configs/zero3.yaml")
    result = run_command(["bash", "-c", command], timeout=900)
    run_dir = re.search(r"saved and verified: (\S+)", result.output)
    try:
        assert result.returncode == 0 and not result.timed_out, result.output[-6000:]
        assert "running under accelerate_configs/zero3.yaml with 2 processes" in result.output
        metrics = re.search(r"eval_loss ([\d.]+) -> ([\d.]+), eval_rewards/accuracies ([\d.]+) -> ([\d.]+)",
                            result.output)
        assert metrics, result.output[-3000:]
        loss_before, loss_after, accuracy_before, accuracy_after = map(float, metrics.groups())
        assert loss_after < loss_before and accuracy_after > accuracy_before
        # it ends on answers a person can judge: held-out sums answered before -> after, and one reply
        answers = re.search(r"held-out accuracy \(greedy\), before -> after training: ([\d.]+) -> ([\d.]+)",
                            result.output)
        assert answers, result.output[-3000:]
        answered_before, answered_after = map(float, answers.groups())
        assert 0.3 < answered_before < 0.9 and answered_after > answered_before, answers.group()
        reply = re.search(r"^\[trl_ext\] it prints: \[\{'generated_text': '(.*)'\}\]$", result.output, re.M)
        assert reply and reply.group(1).strip().isdigit(), result.output[-2000:]  # a bare number, right or not
        # the try-it command prints what the run said it prints (greedy: the same every time)
        try_it = re.search(r"^\[trl_ext\] try it: (python -c .*)$", result.output, re.M).group(1)
        tried = run_command(["bash", "-c", f". .venv/bin/activate && {try_it}"], timeout=300)
        assert tried.returncode == 0 and tried.output.strip().splitlines()[-1] == reply.group(0).split(": ", 1)[1]
        # quiet: third-party warnings raised every step are filtered (3,774 stderr lines before, 27 after), and no
        # launcher's warning about defaults
        warning_lines = [line for line in result.output.splitlines() if "Warning:" in line]
        assert len(warning_lines) <= 10, warning_lines[:20]
        assert "had defaults used instead" not in result.output
    finally:
        if run_dir and Path(run_dir.group(1)).parent.name == "outputs":  # the demo's own per-run directory
            shutil.rmtree(REPO / run_dir.group(1), ignore_errors=True)
