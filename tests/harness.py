"""The suite's launch helpers, also used by the benchmarks (``bench/`` imports them from here): run a script under
``accelerate launch`` with 2 CPU processes and real DeepSpeed ZeRO, FSDP2 or DDP, each launch in its own killable
process group; the scripts under ``tests/scripts``; ``run_training``.

The DeepSpeed config sets ``stage3_param_persistence_threshold: 0`` so the tiny model's parameters are really
partitioned under ZeRO-3. Every launch has a hard timeout and runs in its own process group, which is killed as a
whole on timeout or error: no stray ranks, no hangs. Nothing here imports ``trl_ext``: a benchmark's own process
starts without it.
"""

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
# Set by .ci/oldest.sh: DeepSpeed 0.19.2 cannot run several engines one after another in one process, so there each
# training run is a launch of its own, and those launches run beside CI's other legs
ONE_RUN_PER_LAUNCH = "TRL_EXT_TESTS_ONE_RUN_PER_LAUNCH"
MANY_TIMEOUT = 600  # seconds for a shared launch (run_many.py)


def hang_bound(seconds: float) -> float:
    """A launch's time bound: ``seconds``, or in the one-run-per-launch leg at least a shared launch's. Its launches
    run beside CI's other legs: at load 13-16 on 2 cores, a resumed 2-process run printed nothing in 240 s (2026-12-03).

    Args:
        seconds: the bound the test asks for.

    Returns:
        The bound to use.
    """
    return max(seconds, MANY_TIMEOUT) if os.environ.get(ONE_RUN_PER_LAUNCH) else seconds


def ask_bench(script: str, request: dict) -> dict:
    """A bench module's answer to a JSON request on its standard input (tests never import bench/, see
    tests/unit/test_layout.py): ``python bench/<script>`` run with ``request``, its JSON output parsed.

    Args:
        script: the module's file name under bench/ (``_pairing.py``).
        request: what it is asked.

    Returns:
        Its answer.
    """
    done = subprocess.run([sys.executable, str(REPO / "bench" / script)], input=json.dumps(request),
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def deepspeed_config(stage: int, **overrides) -> dict:
    """A DeepSpeed config for ZeRO ``stage``, batch settings left to the trainer ("auto").

    Args:
        stage: the ZeRO stage (2 or 3).
        **overrides: extra ``zero_optimization`` settings.

    Returns:
        The config as a dict, ready for ``json.dumps``.
    """
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=True)
    zero.update(overrides)
    return {
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
    }


def write_accelerate_config(directory: Path, backend: str, num_processes: int = 2, **zero_overrides) -> Path:
    """Write an accelerate config (and its DeepSpeed JSON) for a launch on this machine.

    Args:
        directory: where the files go (created if missing).
        backend: "ddp", "zero2", "zero3" or "fsdp2" (the repository's accelerate_configs/fsdp2.yaml).
        num_processes: processes to start.
        **zero_overrides: extra ``zero_optimization`` settings for the DeepSpeed backends.

    Returns:
        The accelerate config's path.
    """
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "num_machines": 1,
        "machine_rank": 0,
        "num_processes": num_processes,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
    }
    if backend == "fsdp2":  # the repository's own config, as users run it
        config.update(yaml.safe_load((REPO / "accelerate_configs" / "fsdp2.yaml").read_text()),
                      num_processes=num_processes)
    elif backend == "ddp":
        # MULTI_GPU makes accelerate start one process per rank (torchrun); without a GPU trl_ext picks gloo.
        # (MULTI_CPU would need mpirun.)
        config.update(distributed_type="MULTI_GPU", use_cpu=False, mixed_precision="no")
    else:
        from tests import deepspeed_op

        deepspeed_op.build()  # before any rank needs it (see tests/deepspeed_op.py)
        stage = {"zero2": 2, "zero3": 3}[backend]
        ds_path = directory / f"ds_{backend}.json"
        ds_path.write_text(json.dumps(deepspeed_config(stage, **zero_overrides), indent=2))
        config.update(
            distributed_type="DEEPSPEED",
            deepspeed_config={"deepspeed_config_file": str(ds_path), "zero3_init_flag": stage == 3},
        )
    path = directory / f"accelerate_{backend}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class Launch:
    returncode: int
    output: str
    timed_out: bool


def accelerate_launch(script: str | Path, script_args: list[str], accelerate_config: Path, timeout: float = 300,
           env: dict | None = None) -> Launch:
    """Run ``accelerate launch --config_file CONFIG SCRIPT ARGS`` on a free port.

    Args:
        script: the script to launch.
        script_args: its arguments.
        accelerate_config: from ``write_accelerate_config``.
        timeout: seconds before the whole process tree is killed.
        env: variables added to this process's environment.

    Returns:
        A ``Launch`` with the exit code, stdout and stderr combined, and whether it timed out.
    """
    # Port 0: accelerate picks a free one (its get_free_port), so parallel launches never collide.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config),
           "--main_process_port", "0", str(script), *script_args]
    return run_command(cmd, timeout, env)


def run_command(cmd: list[str], timeout: float = 300, env: dict | None = None,
                on_start: Callable[[subprocess.Popen], None] | None = None) -> Launch:
    """Run ``cmd`` in the repository in its own process group; kill the whole tree when it ends or times out.

    Args:
        cmd: the command line.
        timeout: seconds before the whole process tree is killed.
        env: variables added to this process's environment (with ``PYTHONUNBUFFERED=1``, ``OMP_NUM_THREADS=1``).
        on_start: called with the started process, before the wait (a test that acts on the run while it goes).

    Returns:
        A ``Launch`` with the exit code, stdout and stderr combined, and whether it timed out.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    # Output goes to a file, not a pipe: a rank that outlives the launcher cannot block us by holding a pipe open.
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        if on_start is not None:
            on_start(proc)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_tree(proc)
        log.seek(0)
        return Launch(proc.returncode, log.read(), timed_out)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process below it (torchrun may start ranks in their own sessions)."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for p in [*family, psutil.Process(proc.pid) if proc.poll() is None else None]:
        if p is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(family, timeout=10)


def print_ratio_table(results: dict[str, list[dict]], metrics: dict[str, str], anchor: str) -> None:
    """Print each variant's median per metric, and its ratio to the anchor's (the library we compare against).

    Args:
        results: variant -> one dict per repeat, holding every key of ``metrics``.
        metrics: key -> column title ("save (s)", "peak growth (MiB)").
        anchor: the variant the ratios divide by.
    """
    med = {v: {k: statistics.median(r[k] for r in runs) for k in metrics} for v, runs in results.items()}
    width = max(len(v) for v in med) + 2
    titles = [*metrics.values(), *(f"{t.split(' (')[0]} vs {anchor}" for t in metrics.values())]
    print("\n" + "variant".ljust(width) + "   ".join(titles))
    for variant, values in med.items():
        cells = [f"{values[k]:.3f}".rjust(len(t)) for k, t in metrics.items()]
        cells += [f"{values[k] / max(med[anchor][k], 1e-9):.2f}".rjust(len(t))
                  for k, t in zip(metrics, titles[len(metrics):], strict=True)]
        print(variant.ljust(width) + "   ".join(cells))


SCRIPTS = Path(__file__).resolve().parent / "scripts"


def run_training(tmp_path: Path, backend: str, trainer: str, *extra: str, timeout: float = 300) -> dict:
    """Train ``trainer`` on 2 processes under ``backend`` and return rank 0's report (asserting success), with the
    launch's combined output under ``"output"``."""
    config = write_accelerate_config(tmp_path / "configs", backend)
    out = tmp_path / "out"
    result = accelerate_launch(SCRIPTS / "train.py", ["--trainer", trainer, "--output_dir", str(out), *extra], config,
                               timeout)
    assert not result.timed_out, f"launch timed out after {timeout}s:\n{result.output[-4000:]}"
    assert result.returncode == 0, f"launch failed ({result.returncode}):\n{result.output[-6000:]}"
    return {**json.loads((out / "report_rank0.json").read_text()), "output": result.output}


def forked_ranks(target: Callable, args_of_rank: Callable[[int, object], tuple], ranks: int = 2,
                 timeout: float = 60, hung: str = "a rank did not finish within 60 s") -> list:
    """``target(*args_of_rank(rank, results))`` in ``ranks`` forked processes (the parent's imports: no second
    interpreter start-up); each puts what it found on ``results``, a queue. Fails the test, killing them, when one has
    not ended within ``timeout`` seconds.

    Returns:
        What the processes put on the queue, one item each.
    """
    import multiprocessing

    import pytest

    context = multiprocessing.get_context("fork")
    results = context.Queue()
    processes = [context.Process(target=target, args=args_of_rank(rank, results)) for rank in range(ranks)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout)
        if process.is_alive():
            for other in processes:
                other.kill()
            pytest.fail(hung)
    return [results.get(timeout=5) for _ in processes]
