"""Run a training function on several processes from a notebook (or any plain Python process): ``launch``.

    from trl_ext.launching.notebook import launch

    def train(output_dir):
        trainer = SFTTrainer(model="trl-ext/tiny-llama", args=SFTConfig(output_dir=output_dir), ...)
        trainer.train()
        trainer.save_model()                      # on every rank under ZeRO-3
        return [log["loss"] for log in trainer.state.log_history if "loss" in log]

    losses = launch(train, "outputs/zero3-run", num_processes=2, zero_stage=3)

Built on accelerate's ``notebook_launcher``: the processes are forked, so ``train`` may be defined in the notebook.
What ``launch`` adds:
- DeepSpeed ZeRO for the new processes, set up as ``accelerate launch`` with a DeepSpeed config would
  (``"auto"`` values filled from the trainer's config). The function's code is the same as in a script.
- rank 0's return value comes back to the caller (keep it small and picklable: losses, metrics, paths).
- it can be called again, and after single-process training in the same kernel: the kernel's accelerate state is
  set aside for the launch and restored afterwards, and each launch's rendezvous binds a free port of its own.
- without a GPU the processes run on CPU with gloo (``trl_ext``'s configs pick it, fp32).
"""

import contextlib
import functools
import json
import os
import pickle
import sys
import tempfile
from pathlib import Path

import torch

from trl_ext import patches
from trl_ext.errors import ConfigError, SetupError
from trl_ext.process import env_rank

ZERO_STAGES = (0, 1, 2, 3)
_RESULT_FILE = "rank0_result.pkl"


def zero_config(stage: int) -> dict:
    """A DeepSpeed config for ZeRO ``stage`` with everything else left to the trainer ("auto") or to DeepSpeed.

    DeepSpeed's defaults are kept on purpose: under ZeRO-3 parameters smaller than
    ``stage3_param_persistence_threshold`` (1e5 elements) stay whole on every rank, which is what you want on a real
    model. A tiny test model is made only of such parameters: pass
    ``deepspeed={"zero_optimization": {"stage3_param_persistence_threshold": 0}}`` to partition them all.
    """
    return {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
    }


def _deepspeed_config(zero_stage: int | None, deepspeed: dict | str | os.PathLike | None) -> dict | None:
    """``zero_config(zero_stage)`` with ``deepspeed`` (a dict or a JSON file) merged over it, section by section."""
    if zero_stage is not None and zero_stage not in ZERO_STAGES:
        raise ConfigError(f"zero_stage must be one of {ZERO_STAGES} (or None for no DeepSpeed), got {zero_stage!r}")
    if isinstance(deepspeed, (str, os.PathLike)):
        path = Path(deepspeed)
        if not path.is_file():
            raise ConfigError(f"deepspeed: {path} is not a file; pass a DeepSpeed config as a dict or a JSON file path")
        deepspeed = json.loads(path.read_text())
    if deepspeed is not None and not isinstance(deepspeed, dict):
        raise ConfigError(f"deepspeed must be a dict or a JSON file path, got {type(deepspeed).__name__}")
    if zero_stage is None and deepspeed is None:
        return None
    config = zero_config(zero_stage if zero_stage is not None else 2)
    for key, value in (deepspeed or {}).items():
        both_dicts = isinstance(value, dict) and isinstance(config.get(key), dict)
        config[key] = {**config[key], **value} if both_dicts else value
    if zero_stage is not None and config["zero_optimization"].get("stage") != zero_stage:
        raise ConfigError(f"zero_stage={zero_stage} but the deepspeed config sets stage "
                         f"{config['zero_optimization'].get('stage')}; give the stage once")
    return config


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """Set environment variables for the forked processes; restore the kernel's afterwards, including what the
    launcher itself adds (torch's elastic agent sets TORCHELASTIC_* variables in the calling process)."""
    before = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def _run_and_report(function, result_dir: str):
    """What each forked process runs: the function, then rank 0 writes its return value for the caller."""

    @functools.wraps(function)  # torch's elastic launcher names the run after the function
    def run(*args):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # forked: the kernel's pool size is inherited
        result = function(*args)
        if env_rank() == 0:
            try:
                payload = pickle.dumps(result)
            except Exception as exc:  # any pickling failure gets the same advice
                raise ConfigError(f"launch(): rank 0's return value cannot be sent back ({exc}); return plain data "
                                "such as a list of losses or a path") from exc
            (Path(result_dir) / _RESULT_FILE).write_bytes(payload)
        if torch.distributed.is_initialized():
            # Every rank waits for the others before any closes its connections: a rank that returned without a
            # collective (nothing to train) would otherwise close them while another still finishes connecting,
            # and that one fails ("Gloo connectFullMesh failed ... Connection closed by peer").
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()  # a clean exit: gloo/NCCL warn about a live group otherwise

    return run


class _DropBanner:
    """A stream that forwards everything except accelerate's "Launching training on ..." line, which names the
    accelerator type accelerate guessed ("2 CUDAs" on a CPU-only machine); the line above it says what runs."""

    def __init__(self, stream):
        self.stream, self.dropping = stream, False

    def write(self, text: str) -> int:
        if text.startswith("Launching training on"):
            self.dropping = True  # print() writes the newline separately
            return len(text)
        if self.dropping and text == "\n":
            self.dropping = False
            return len(text)
        self.dropping = False
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def _without_launcher_banner():
    with contextlib.redirect_stdout(_DropBanner(sys.stdout)):
        yield


def launch(function, *args, num_processes: int = 2, zero_stage: int | None = None,
           deepspeed: dict | str | None = None):
    """Run ``function(*args)`` in ``num_processes`` new processes and return rank 0's return value.

    ``zero_stage``: 0-3 for DeepSpeed ZeRO (see ``zero_config``), None for plain data parallel (DDP).
    ``deepspeed``: a DeepSpeed config, dict or JSON file, merged over ``zero_config(zero_stage)`` section by
    section (so ``{"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}`` keeps the stage).
    Inside ``function`` build the trainer as in a script; use ``trl_ext``'s configs so a machine without a GPU
    trains on CPU with gloo. Under ZeRO-3, call ``trainer.save_model()`` on every rank.

    Args:
        function: a picklable function that trains; it runs in every process.
        *args: passed to ``function``.
        num_processes: how many processes (2 or more; one per GPU on a GPU machine).
        zero_stage: 0-3 for DeepSpeed ZeRO, None for DDP.
        deepspeed: DeepSpeed settings (dict or JSON file) merged over the stage's defaults.

    Returns:
        What ``function`` returned on rank 0.

    Raises:
        errors.ConfigError: fewer than 2 processes, or more than the GPUs.
        errors.SetupError: CUDA is already initialized in this process, or it is itself a distributed process.
    """
    from accelerate import notebook_launcher

    _refuse_what_cannot_launch(num_processes)
    ds_config = _deepspeed_config(zero_stage, deepspeed)
    with tempfile.TemporaryDirectory(prefix="trl_ext-launch-") as scratch:
        env = _processes_environment(ds_config, scratch)
        what = f"DeepSpeed ZeRO-{ds_config['zero_optimization']['stage']}" if ds_config else "data parallel (DDP)"
        where = "" if torch.cuda.is_available() else " on CPU (gloo)"
        print(f"[trl_ext] launch: {num_processes} processes, {what}{where}", flush=True)
        with (_environment(env), accelerate_state_set_aside(), no_import_check(),
              _without_launcher_banner()):
            # The rendezvous store binds a free port itself and holds it, as torchrun --standalone does: a port picked
            # beforehand is free only until the launch binds it, seconds later under load, and any process on the
            # machine can take it meanwhile.
            notebook_launcher(_run_and_report(function, scratch), args=args, num_processes=num_processes,
                              use_port="0", rdzv_backend="c10d", rdzv_endpoint="localhost:0")
        result_file = Path(scratch) / _RESULT_FILE
        return pickle.loads(result_file.read_bytes()) if result_file.exists() else None


def _refuse_what_cannot_launch(num_processes) -> None:
    """Fewer than 2 processes, more than the GPUs, CUDA already initialized here, or a process group here: one line."""
    if not isinstance(num_processes, int) or num_processes < 2:
        raise ConfigError(f"num_processes must be 2 or more, got {num_processes!r}; for one process call "
                          "the function directly")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise SetupError("launch() forks new processes, and CUDA is already initialized in this one (a cell used "
                         "the GPU); restart the kernel and call launch() before anything touches the GPU")
    if torch.cuda.is_available() and torch.cuda.device_count() < num_processes:  # device_count() does not init CUDA
        raise ConfigError(f"num_processes={num_processes} but this machine has {torch.cuda.device_count()} GPU(s); "
                          "use one process per GPU")
    if torch.distributed.is_initialized():
        raise SetupError("launch() was called inside a distributed process (a process group exists); call it "
                         "from the notebook or a plain `python` process, not under accelerate launch/torchrun")


def _processes_environment(ds_config: dict | None, scratch: str) -> dict[str, str]:
    """The variables the launched processes get: what ``accelerate launch`` would set for the engine."""
    env = {
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),  # as torchrun: no thread oversubscription
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false"),  # no fork warning
    }
    if ds_config is None and not torch.cuda.is_available():
        # Without this accelerate sets up no data parallelism on CPU (distributed type NO): each process would
        # train alone on all the data while torch.distributed reports 2 processes.
        env["ACCELERATE_USE_CPU"] = "true"
    if ds_config is not None:
        config_file = Path(scratch) / "deepspeed.json"
        config_file.write_text(json.dumps(ds_config, indent=2))
        # What `accelerate launch` sets for a DeepSpeed config; TrainingArguments turns it into a plugin.
        env.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=str(config_file),
                   ACCELERATE_DEEPSPEED_ZERO3_INIT=str(ds_config["zero_optimization"]["stage"] == 3).lower())
    return env


def no_import_check():
    """Context: accelerate's ``notebook_launcher`` without its imported-libraries refusal (patch
    ``notebook-import-check``); the caller checks ``torch.cuda.is_initialized()`` itself."""
    import accelerate.launchers

    return patches.swapped("notebook-import-check", accelerate.launchers, "are_libraries_initialized",
                           lambda *names: [])


@contextlib.contextmanager
def accelerate_state_set_aside():
    """Context: accelerate's shared state emptied for a notebook launch, the kernel's put back after it (patch
    ``accelerate-state-set-aside``)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    if not patches.applies("accelerate-state-set-aside"):
        yield
        return
    saved = {cls: dict(cls._shared_state) for cls in (PartialState, AcceleratorState, GradientState)}
    for cls in saved:
        cls._shared_state.clear()
    try:
        yield
    finally:
        for cls, state in saved.items():
            cls._shared_state.clear()
            cls._shared_state.update(state)
