"""Run a script under ``accelerate launch`` with 2 CPU processes and real DeepSpeed ZeRO (or DDP).

The DeepSpeed config sets ``stage3_param_persistence_threshold: 0`` so the tiny model's parameters are really
partitioned under ZeRO-3. Every launch has a hard timeout and runs in its own process group, which is killed as a
whole on timeout or error: no stray ranks, no hangs.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def deepspeed_config(stage: int, **overrides) -> dict:
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
    """``backend``: "ddp", "zero2" or "zero3". Returns the accelerate config path."""
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
    if backend == "ddp":
        # MULTI_GPU makes accelerate start one process per rank (torchrun); without a GPU trl_ext picks gloo.
        # (MULTI_CPU would need mpirun.)
        config.update(distributed_type="MULTI_GPU", use_cpu=False, mixed_precision="no")
    else:
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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Launch:
    returncode: int
    output: str
    timed_out: bool


def launch(script: str | Path, script_args: list[str], accelerate_config: Path, timeout: float = 300,
           env: dict | None = None) -> Launch:
    """Run ``accelerate launch --config_file CONFIG SCRIPT ARGS`` and return its exit code and combined output."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config),
           "--main_process_port", str(free_port()), str(script), *script_args]
    return run_command(cmd, timeout, env)


def run_command(cmd: list[str], timeout: float = 300, env: dict | None = None) -> Launch:
    """Run ``cmd`` in the repository in its own process group; kill the whole tree on timeout. Output combined."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    # Output goes to a file, not a pipe: a rank that outlives the launcher cannot block us by holding a pipe open.
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
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


def run_training(tmp_path: Path, backend: str, trainer: str, *extra: str, timeout: float = 300) -> dict:
    """Train ``trainer`` on 2 processes under ``backend`` and return rank 0's report (asserting success), with the
    launch's combined output under ``"output"``."""
    config = write_accelerate_config(tmp_path / "configs", backend)
    out = tmp_path / "out"
    result = launch(SCRIPTS / "train.py", ["--trainer", trainer, "--output_dir", str(out), *extra], config, timeout)
    assert not result.timed_out, f"launch timed out after {timeout}s:\n{result.output[-4000:]}"
    assert result.returncode == 0, f"launch failed ({result.returncode}):\n{result.output[-6000:]}"
    return {**json.loads((out / "report_rank0.json").read_text()), "output": result.output}
