"""Run a recipe under the accelerate config its command line names.

`accelerate launch recipes/dpo.py --config accelerate_configs/zero3.yaml` hands `--config` to the script, not to
accelerate: with TRL's own scripts such a line fails on unknown keys or trains without DeepSpeed. Here every
``--config`` file is read and told apart by content (an accelerate config has ``distributed_type``); an accelerate
config makes the recipe re-launch itself once as
``accelerate launch --config_file CONFIG --num_processes N recipe.py <the other arguments>``.
"""

import os
import sys
from pathlib import Path

import torch
import yaml
from accelerate.utils.other import get_free_port

from trl_ext.errors import UsageError
from trl_ext.process import env_rank, env_world_size
from trl_ext.scheduling import node as slurm_node

RELAUNCHED = "TRL_EXT_RELAUNCHED"  # set in the re-launched processes: guards against a re-launch loop
ACCELERATE_KEYS = ("distributed_type", "compute_environment")
# The launcher's own variables: the re-launched `accelerate launch` must start from a clean slate.
LAUNCHER_ENV_PREFIXES = ("ACCELERATE_", "TORCHELASTIC_")
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def read_config(path: str) -> dict:
    """A ``--config`` file's mapping, or a one-line error for a file that is missing or not a YAML mapping."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"config file '{path}' does not exist.")
    try:
        data = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise UsageError(f"config file '{path}' is not valid YAML ({first}).") from None
    if not isinstance(data, dict) or not data:
        raise UsageError(
            f"config file '{path}' is neither a recipe config (a YAML mapping of training options, like "
            "recipes/configs/dpo.yaml) nor an accelerate config (with distributed_type, like "
            "accelerate_configs/zero3.yaml)."
        )
    return data


def is_accelerate_config(config: dict) -> bool:
    return any(key in config for key in ACCELERATE_KEYS)


def split_configs(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    """``(accelerate_config, recipe_config, other_args)`` from a recipe's arguments; ``--config`` may appear twice,
    once for each kind, in either order."""
    accelerate_config, recipe_config, rest = None, None, []
    args = iter(argv)
    for arg in args:
        if arg == "--config" or arg.startswith("--config="):
            path = arg.partition("=")[2] if "=" in arg else next(args, None)
            if not path:
                raise UsageError("--config needs a file: a recipe config (recipes/configs/*.yaml) or an accelerate "
                                 "config (accelerate_configs/*.yaml).")
            kind = "accelerate" if is_accelerate_config(read_config(path)) else "recipe"
            if (accelerate_config if kind == "accelerate" else recipe_config) is not None:
                raise UsageError(f"two {kind} configs given with --config; pass one.")
            if kind == "accelerate":
                accelerate_config = path
            else:
                recipe_config = path
        else:
            rest.append(arg)
    return accelerate_config, recipe_config, rest


def take_option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """Remove ``--name VALUE`` / ``--name=VALUE`` from ``argv``; returns ``(value, remaining)``."""
    value, rest, args = None, [], iter(argv)
    for arg in args:
        if arg == f"--{name}":
            value = next(args, None)
        elif arg.startswith(f"--{name}="):
            value = arg.partition("=")[2]
        else:
            rest.append(arg)
    return value, rest


def default_num_processes() -> int:
    """One process per visible GPU; 2 CPU processes (gloo) on a machine without one. Under an outer multi-process
    launch (``accelerate launch --num_processes N recipe.py --config ...``), the N the user asked for."""
    outer = env_world_size()
    if outer > 1:
        return outer
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def relaunch_command(accelerate_config: str, script: str, script_args: list[str], num_processes: int) -> list[str]:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", accelerate_config,
           "--num_processes", str(num_processes)]
    config = read_config(accelerate_config)
    if int(config.get("num_machines", 1)) <= 1 and "main_process_port" not in config:
        cmd += ["--main_process_port", str(get_free_port())]  # the default port may be held by an outer launch
    return [*cmd, script, *script_args]


def launch_command(accelerate_config: str, script: str, script_args: list[str],
                   num_processes: int | None = None) -> tuple[list[str], str | None]:
    """The ``accelerate launch`` command that runs ``script`` under ``accelerate_config``, and the line to print (None:
    nothing to say here). On one node of a Slurm job (``scheduling.node``), Slurm's machines, ranks, address and port
    replace the config's own; elsewhere, ``num_processes`` (default: one per GPU, 2 on CPU) on this machine.

    Args:
        accelerate_config: the accelerate config file.
        script: the recipe.
        script_args: its arguments.
        num_processes: the processes the user asked for (``--num_processes``), or None.

    Returns:
        The command, and the line that says how it runs (printed by the first node only under Slurm).
    """
    under_slurm = slurm_node.machine_args(num_processes)
    if under_slurm is not None:
        machines, line = under_slurm
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", accelerate_config, *machines,
               script, *script_args]
        return cmd, line if os.environ.get("SLURM_NODEID", "0") == "0" else None
    n = num_processes or default_num_processes()
    return relaunch_command(accelerate_config, script, script_args, n), (
        f"running under {accelerate_config} with {n} processes: accelerate launch --config_file {accelerate_config} "
        f"--num_processes {n} {script} ...")


def relaunch(accelerate_config: str, script: str, script_args: list[str], num_processes: int | None = None):
    """Replace this process by ``accelerate launch`` running ``script`` under ``accelerate_config``. Does not return.

    Under an outer multi-process launch only its first process re-launches; the others leave quietly.
    """
    if os.environ.get(RELAUNCHED):
        raise UsageError(f"already re-launched under {os.environ[RELAUNCHED]}, and an accelerate config is still on "
                         "the command line; pass it once.")
    if env_rank() != 0:
        sys.exit(0)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and not k.startswith(LAUNCHER_ENV_PREFIXES)}
    env[RELAUNCHED] = accelerate_config
    env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets anyway, announcing it in a 4-line banner
    cmd, line = launch_command(accelerate_config, script, script_args, num_processes)
    if line is not None:
        print(f"[trl_ext] {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execve(sys.executable, cmd, env)
