"""Where a recipe's processes come from, decided before torch or TRL is imported.

`accelerate launch recipes/dpo.py --config accelerate_configs/zero3.yaml` hands `--config` to the script, not to
accelerate: with TRL's own scripts such a line fails on unknown keys or trains without DeepSpeed. Here every
``--config`` file is read and told apart by content (an accelerate config has ``distributed_type``), and what happens
depends on who started this process (``placement.orchestrators``), decided once (``launching.decision``):

- a rank that torchrun (or ``accelerate launch``) started, on one machine or many, elastic or not: it trains as that
  rank, with the accelerate config applied in this process (``launching.in_process``); nothing is re-launched;
- one process per machine (Slurm through ``recipes/slurm.sbatch``, SkyPilot, Kubernetes pods with torchrun's ``PET_*``
  variables, LeaderWorkerSet): the node launcher (``launching.node``) starts this machine's ranks with
  ``accelerate launch --num_machines N --machine_rank R ...``, the orchestrator's machines, address and port in place
  of the config's; for an elastic job (``PET_NNODES=MIN:MAX``), torchrun in a c10d rendezvous (``launching.elastic``);
- a Ray job's driver (``ray job submit -- python recipe.py ...``): it replaces itself by ``python -m trl_ext.ray
  recipe.py ...``, which runs the ranks as a Ray Train worker group on the cluster's nodes, each one of the ranks above;
  ``--num_processes`` takes a range ``MIN-MAX`` there;
- neither (``python recipe.py``): under an accelerate config the recipe replaces itself by
  ``accelerate launch --config_file CONFIG --num_processes N recipe.py <the other arguments>`` on this machine;
  without one it trains in this process. With the memory tier (``--memory_checkpoint_steps``), that launch restarts
  its ranks after one is lost (``--max_restarts``, ``TRL_EXT_MAX_FAILURES`` times), and they resume from memory.

The decision reads only the command line, the config files and the environment: a re-launch costs a process start,
not an import of torch and TRL. The input's checks that need TRL run in the ranks. The processes a re-launch starts
carry the decision that started them (``decision.LAUNCH_ENV``) and follow it.
"""

import os
import socket
import sys
from pathlib import Path

import yaml

from trl_ext import process
from trl_ext.errors import UsageError
from trl_ext.launching import elastic
from trl_ext.launching.decision import LAUNCH_ENV, Become, Decision, decide, decided_here, handed_down
from trl_ext.placement import failure_limit, orchestrators
from trl_ext.placement.orchestrators import torchrun
from trl_ext.process import notice

ACCELERATE_RUN = "trl_ext.launching.accelerate_run"  # accelerate's launch, ending with the ranks' own exit code
ACCELERATE_KEYS = ("distributed_type", "compute_environment")
# accelerate's own variables: a new `accelerate launch` starts from a clean slate (torchrun's too: is_launchers)
ACCELERATE_ENV_PREFIX = "ACCELERATE_"
# The default where no accelerate config is given: inside the package, so that an installed wheel has it too (a copy
# of accelerate_configs/ddp.yaml, which users copy; tests/unit/test_launch.py keeps the two equal).
DATA_PARALLEL = Path(__file__).resolve().parent / "configs" / "ddp.yaml"
RELAUNCHES = (Become.ACCELERATE, Become.MACHINE)  # the launches that start ranks with the accelerate config applied


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


def free_port() -> int:
    """A TCP port free on this machine now (accelerate's helper would import torch first)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def default_num_processes(job: orchestrators.Job | None = None) -> int:
    """One process per GPU of this machine; 2 CPU processes (gloo) on a machine without one."""
    return orchestrators.default_per_node(job)


def _processes(value: str | None) -> int | None:
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"--num_processes {value!r} is not a number of processes (1 or more).")
    return int(value)


def relaunch_command(accelerate_config: str, script: str, script_args: list[str], num_processes: int,
                     restarts: int = 0) -> list[str]:
    cmd = [sys.executable, "-m", ACCELERATE_RUN, "--config_file", accelerate_config, "--num_processes",
           str(num_processes)]
    if restarts:
        cmd += ["--max_restarts", str(restarts)]
    config = read_config(accelerate_config)
    if int(config.get("num_machines", 1)) <= 1 and "main_process_port" not in config:
        cmd += ["--main_process_port", str(free_port())]  # the default port may be held by another run here
    return [*cmd, script, *script_args]


def memory_tier_asked(args: list[str], recipe_config: str | None) -> bool:
    """Whether a recipe's arguments (or its recipe config) ask for memory checkpoints (``memory_checkpoint_steps``
    above 0), read before TRL is imported."""
    value, _ = take_option(args, "memory_checkpoint_steps")
    if value is None and recipe_config is not None:
        value = read_config(recipe_config).get("memory_checkpoint_steps")
    return str(value).strip().isdigit() and int(str(value).strip()) > 0


def machine_args(job: orchestrators.Job, num_processes: int | None = None) -> tuple[list[str], str]:
    """The ``accelerate launch`` arguments for one machine of a job that an orchestrator placed on several, and the
    line that says what they replace.

    Args:
        job: the job, as the node launcher passed it on (``launching.node``).
        num_processes: the total the user asked for (``--num_processes``), else ``job.per_node`` (or one per GPU, 2
            on CPU) on every machine.

    Returns:
        ``(arguments, line)``: ``--num_machines``, ``--machine_rank``, ``--main_process_ip``,
        ``--main_process_port``, ``--num_processes`` and DeepSpeed's per-machine launcher (torchrun, not pdsh).

    Raises:
        UsageError: ``--num_processes`` that does not divide among the machines.
    """
    per_node = job.per_node or default_num_processes(job)
    total = num_processes or per_node * job.nodes
    if total % job.nodes:
        raise UsageError(f"--num_processes {total} does not divide among {job.nodes} machines; give a multiple of "
                         f"{job.nodes}.", every_rank=True)
    args = ["--num_machines", str(job.nodes), "--machine_rank", str(job.node_rank),
            "--main_process_ip", job.address or "127.0.0.1", "--main_process_port", str(job.port),
            "--num_processes", str(total), "--rdzv_backend", "static", "--same_network",
            "--deepspeed_multinode_launcher", "standard"]
    line = (f"{job.label} (restart {job.restart}): {job.nodes} machine(s), this one number "
            f"{job.node_rank}, {total} processes, rendezvous {job.address}:{job.port}; these replace the accelerate "
            "config's machines, ranks, address and port")
    return args, line


def _exec(cmd: list[str], set_env: dict[str, str], strip_launcher: bool = True) -> None:
    env = dict(os.environ)
    if strip_launcher:  # a launch from a clean slate: what it starts follows set_env's decision, or decides anew
        env = {k: v for k, v in env.items() if not k.startswith(ACCELERATE_ENV_PREFIX) and not torchrun.is_launchers(k)
               and k != LAUNCH_ENV}
    env.update(set_env)
    env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets anyway, announcing it in a 4-line banner
    env.setdefault(*torchrun.AGENT_LOG_LEVEL)  # the ranks say how they ended; torchrun's agents' log says it again
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, cmd, env)


def start(script: str, argv: list[str]) -> list[str]:
    """Decide where this recipe trains (see the module's docstring) and act on it: re-launch (does not return), or
    apply the accelerate config here and return the arguments to parse. A second call in the same process returns
    the same arguments and does nothing else (the first recorded its decision).

    Args:
        script: the recipe's path (``sys.argv[0]``).
        argv: its arguments.

    Returns:
        ``argv`` without the accelerate config and ``--num_processes``, for TRL's parser.

    Raises:
        UsageError: contradictory launcher variables, an unreadable config, ``--num_processes`` that cannot apply.
    """
    accelerate_config, recipe_config, rest = split_configs(argv)
    num_processes, rest = take_option(rest, "num_processes")
    rest = [*rest, "--config", recipe_config] if recipe_config else rest
    job = orchestrators.current()
    decision = decide(job, accelerate=accelerate_config is not None)
    if decision.decided_before:
        return rest
    if decision.become is Become.RAY_DRIVER:  # a Ray job's driver: a worker group
        _exec([sys.executable, "-m", "trl_ext.ray", script, *argv], handed_down(Become.RAY_DRIVER),
              strip_launcher=False)
    asked = _processes(num_processes)
    process.speaks_here(orchestrators.machine_speaks(job))  # one machine says what all would say
    if decision.become is Become.RANK:
        _train_here(job, decision, accelerate_config, asked)
        return rest
    if decision.become is Become.MACHINE:  # the node launcher's child: this machine's ranks
        config = accelerate_config or str(DATA_PARALLEL)
        if accelerate_config is None:
            notice(f"no accelerate config on {job.orchestrator}: {os.path.relpath(config)} (data parallel)")
        if job.elastic:  # torchrun's ranks, each deciding as a rank and applying the config in its own process
            cmd, line = elastic.command(job, sys.executable, script, ["--config", config, *rest], asked)
            notice(line)
            _exec(cmd, dict([torchrun.SIGNALS_OPTION, torchrun.UNSHARED_STORE]))
        machines, line = machine_args(job, asked)
        notice(line)
        cmd = [sys.executable, "-m", ACCELERATE_RUN, "--config_file", config, *machines, script, *rest]
        _exec(cmd, {**handed_down(Become.MACHINE), **dict([torchrun.SIGNALS_OPTION])})
    if decision.become is Become.NODE_LAUNCHER:
        become_node_launcher([script, *argv])
    n = asked or default_num_processes(job)
    restarts = failure_limit.max_failures() if memory_tier_asked(rest, recipe_config) else 0
    again = (f"; a lost rank restarts them (at most {restarts} times, {failure_limit.setting()}), resuming from "
             "memory" if restarts else "")
    print(f"[trl_ext] running under {accelerate_config} with {n} processes: accelerate launch --config_file "
          f"{accelerate_config} --num_processes {n} {script} ...{again}", file=sys.stderr, flush=True)
    env = {**handed_down(Become.ACCELERATE), **(dict([torchrun.UNSHARED_STORE]) if restarts else {})}
    _exec(relaunch_command(accelerate_config, script, rest, n, restarts), env)


def _train_here(job: orchestrators.Job | None, decision: Decision, accelerate_config: str | None,
                asked: int | None) -> None:
    """This process trains: as the rank that torchrun, ``accelerate launch`` or Ray Train started (the accelerate
    config applied here), or as the one process; said once, and recorded for this process's next ask."""
    relaunched = decision.started_by in RELAUNCHES
    if accelerate_config and relaunched:
        raise UsageError(f"already re-launched by trl_ext ({decision.started_by.value}), and an accelerate config "
                         f"({accelerate_config}) is still on the command line; pass it once.")
    if job is not None and job.per_rank:  # torchrun started this process as one rank: train here, as that rank
        if asked is not None and asked != job.world_size:
            raise UsageError(f"--num_processes {asked}: the launcher started {job.world_size} processes; drop "
                             "--num_processes (the launcher decides) or launch that many.")
        applied = ""
        if accelerate_config:
            from trl_ext.launching import in_process

            applied = f"; {accelerate_config} applied in each process ({in_process.apply(accelerate_config, job)})"
        if not relaunched:  # (a re-launch said how it runs already)
            notice(f"{job.describe()}{applied}")
            _warn_shared_store()
    elif asked is not None:
        raise UsageError("--num_processes needs an accelerate config: --config accelerate_configs/<name>.yaml.")
    decided_here()


def _warn_shared_store() -> None:
    """torchrun's agents share their TCP store with the ranks unless told not to; a restarted attempt's ranks then read
    the previous attempt's addresses and hang setting up their process group (pytorch#135712), and a machine joining an
    elastic job waits for an address nobody publishes (pytorch#147064). Said once, where restarts can happen."""
    if torchrun.restarts_share_store():
        notice("torchrun may restart this job (--max-restarts), and its agents share their TCP store with the ranks: "
               "a restarted attempt would hang setting up its processes (pytorch#135712). Start torchrun with "
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (docs/launchers.md).")


def become_node_launcher(command: list[str]) -> None:
    """Replace this process by the node launcher running ``command`` (this machine's process of a job that an
    orchestrator placed on several machines: SkyPilot, pods with torchrun's ``PET_*`` variables, LeaderWorkerSet).

    Args:
        command: the recipe's path and arguments, or ``["trl-ext", <command>, ...]``.
    """
    _exec([sys.executable, "-m", "trl_ext.launching.node", *command], handed_down(Become.NODE_LAUNCHER),
          strip_launcher=False)


def launch_if_asked() -> None:
    """A recipe's first line: under an accelerate config or an orchestrator that places one process per machine,
    start the processes now, before torch and TRL are imported (see ``start``); otherwise nothing. When the recipe
    parses its arguments, ``start`` answers from this decision."""
    if "-h" in sys.argv[1:] or "--help" in sys.argv[1:]:
        return
    start(sys.argv[0], sys.argv[1:])
