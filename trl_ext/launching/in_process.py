"""An accelerate config applied inside a rank that another launcher started (torchrun, a Kubeflow pod, Ray Train).

``accelerate launch --config_file CONFIG`` turns the config into environment variables for its processes
(``ACCELERATE_USE_DEEPSPEED``, ``ACCELERATE_DEEPSPEED_ZERO_STAGE``, ``FSDP_*``, ``ACCELERATE_MIXED_PRECISION``, ...),
which accelerate's state reads when the trainer builds it. A rank started by another launcher sets the same variables
here, computed by accelerate's own launch command (patch ``accelerate-launch-environment``), before anything reads
them; the world (ranks, machines, rendezvous) stays the launcher's.
"""

import contextlib
import os

from trl_ext import patches
from trl_ext.errors import SetupError

# What an accelerate config becomes in its processes' environment; the launch topology (MASTER_*, OMP_NUM_THREADS,
# device masks) is left to the launcher that started this rank.
CONFIG_PREFIXES = ("ACCELERATE_", "FSDP_", "MEGATRON_LM_", "PARALLELISM_CONFIG_")


def environment(config_file: str, world_size: int) -> dict[str, str]:
    """The variables ``accelerate launch --config_file config_file`` would give its processes, as accelerate's launch
    command computes them; nothing is launched.

    Args:
        config_file: the accelerate config.
        world_size: the number of ranks the launcher started.

    Returns:
        The config's variables (names starting with one of ``CONFIG_PREFIXES``).

    Raises:
        SetupError: the installed accelerate moved what this relies on.
    """
    from accelerate.commands import launch
    from accelerate.utils import launch as helpers
    from accelerate.utils.other import get_free_port

    if not patches.applies("accelerate-launch-environment"):
        raise SetupError(f"cannot apply {config_file} in this process with the installed accelerate; start the ranks "
                         f"with `accelerate launch --config_file {config_file}` instead of another launcher.")
    recorded = {}

    def record(prepare):
        def launcher(args):
            env = prepare(args)
            recorded.update(env[1] if isinstance(env, tuple) else env)
        return launcher

    # One machine and a free port: only the variables are wanted, and accelerate checks the port of the launch it
    # would start (this world's port is its launcher's, in use).
    args = launch.launch_command_parser().parse_args([
        "--config_file", config_file, "--num_processes", str(world_size), "--num_machines", "1",
        "--main_process_port", str(get_free_port()), "trl_ext-in-process"])
    name = "accelerate-launch-environment"
    outer = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(CONFIG_PREFIXES)}  # the config's alone
    with contextlib.ExitStack() as stack:
        stack.callback(os.environ.update, outer)
        for launcher, prepare in (("deepspeed_launcher", helpers.prepare_deepspeed_cmd_env),
                                  ("multi_gpu_launcher", helpers.prepare_multi_gpu_env),
                                  ("simple_launcher", helpers.prepare_simple_launcher_cmd_env)):
            stack.enter_context(patches.swapped(name, launch, launcher, record(prepare)))
        launch.launch_command(args)
    return {k: v for k, v in recorded.items() if k.startswith(CONFIG_PREFIXES)}


def apply(config_file: str, job) -> str:
    """Set this rank's environment as ``accelerate launch --config_file config_file`` sets its processes'; variables
    of another accelerate config (an outer ``accelerate launch --config_file``) are replaced.

    Args:
        config_file: the accelerate config.
        job: this rank's ``placement.orchestrators.Job``.

    Returns:
        The engine it selected, in a few words ("DeepSpeed ZeRO-3", "FSDP2", "data parallel").
    """
    env = environment(config_file, job.world_size)
    for key in [k for k in os.environ if k.startswith(CONFIG_PREFIXES) and k not in env]:
        del os.environ[key]
    os.environ.update(env)
    if env.get("ACCELERATE_USE_DEEPSPEED") == "true":
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        return f"DeepSpeed ZeRO-{stage}" if stage else "DeepSpeed"
    if env.get("ACCELERATE_USE_FSDP") == "true":
        return f"FSDP{env['FSDP_VERSION']}" if env.get("FSDP_VERSION") in ("1", "2") else "FSDP"
    return "data parallel"
