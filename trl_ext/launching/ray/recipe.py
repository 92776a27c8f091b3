"""A recipe, or ``trl-ext <command>``, started as a Ray job's driver: ``ray job submit -- python recipes/dpo.py --config
accelerate_configs/zero3.yaml`` (the recipe replaces itself by ``python -m trl_ext.ray recipes/dpo.py ...``, which runs
``main``).

The driver decides what only it can, before any worker starts, without importing torch or TRL: the number of workers
(``--num_processes N`` or ``MIN-MAX``; default one per GPU of the cluster, 2 per node without GPUs), the accelerate
config (``--config``; without one, data parallel), the run's identity (the job's submission id) and its output
directory (``--output_dir``, the recipe config's, else ``outputs/<recipe>-<run>``, made absolute: it is Ray's storage
for the run and must be one every node sees). Every worker then runs the same command with that output directory, as
one rank (``worker``); the input's own checks run there, as under ``accelerate launch``.
"""

import os
import sys
from pathlib import Path

from trl_ext.errors import GAVE_UP, RunFailed, UsageError
from trl_ext.launching.decision import LAUNCH_ENV
from trl_ext.launching.ray import cluster, group
from trl_ext.launching.ray.worker import Task
from trl_ext.placement import failure_limit, orchestrators, ownership
from trl_ext.process.hosted import HOSTED
from trl_ext.settings import environment

# The launch's own variables, not the run's: the workers get theirs from Ray and trl_ext.ray. The memory tier's
# directory is each node's own (its pod's or `ray start`'s environment), not the driver's.
_NOT_PASSED_ON = (orchestrators.NODE_ENV, ownership.RUN_ENV, LAUNCH_ENV, HOSTED, environment.MEMORY_DIR.name)
# accelerate launch's placement options: Ray places the workers
_PLACEMENT = ("num_machines", "machine_rank", "main_process_ip", "main_process_port")


def main(argv: list[str] | None = None) -> int:
    """``python -m trl_ext.ray RECIPE [options]``, or ``python -m trl_ext.ray trl-ext COMMAND [launch options] --
    [options]``: a recipe (as ``launching.launch.start`` hands it over in a Ray job's driver) or ``trl-ext <command>``
    (as ``launching.trl_cli`` does, its options already split) on a Ray Train worker group.

    Args:
        argv: the recipe's path and options, or ``trl-ext``, the command, its launch options, ``--``, its options.

    Returns:
        The driver's exit code.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        raise UsageError("usage: python -m trl_ext.ray RECIPE [options] (in a Ray job's driver: ray job submit -- "
                         "python RECIPE [options] does it)")
    job = orchestrators.current()
    if job is not None and (job.orchestrator != "Ray" or job.per_rank):
        job = None  # not a Ray job's driver: a run of its own, on the cluster at RAY_ADDRESS or on this machine
    if argv[0] == "trl-ext":
        launch_args, training_script_args = _split(argv[2:])
        return run_trl_command(argv[1], launch_args, training_script_args, job)
    return run(argv[0], argv[1:], job)


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    cut = argv.index("--") if "--" in argv else len(argv)
    return argv[:cut], argv[cut + 1:]


def run(script: str, argv: list[str], job: orchestrators.Job | None) -> int:
    """Run the recipe ``script`` on a Ray Train worker group.

    Args:
        script: the recipe's path.
        argv: its options: ``--config`` (an accelerate config, a recipe config, or both), ``--num_processes N`` or
            ``MIN-MAX``, the recipe's own.
        job: the Ray job (its run identity), or None.

    Returns:
        The driver's exit code.
    """
    from trl_ext.launching.launch import DATA_PARALLEL, split_configs, take_option

    accelerate_config, recipe_config, rest = split_configs(argv)
    num_processes, rest = take_option(rest, "num_processes")
    rest = [*rest, "--config", recipe_config] if recipe_config else rest
    asked = cluster.parse_workers(num_processes)
    run_name = _run_name(job)
    output_dir, rest, claim = _run_output(rest, Path(script).stem, run_name)
    if accelerate_config is None:
        group.printer(f"no accelerate config under Ray: {os.path.relpath(DATA_PARALLEL)} (data parallel)")
    config = accelerate_config or str(DATA_PARALLEL)
    task = Task(run=run_name, output_dir=output_dir, cwd=os.getcwd(), env=passed_on(), script=os.path.abspath(script),
                argv=["--config", config, *rest, "--output_dir", output_dir], claim=claim)
    return _launch(task, asked)


def _run_output(args: list[str], name: str, run_name: str) -> tuple[str, list[str], bool]:
    """The run's output directory, absolute: ``--output_dir``, else the recipe config's, else
    ``outputs/<name>-<run>``; with ``args`` without it, and whether the driver claims it (``claims``)."""
    from trl_ext.launching.launch import take_option

    output_dir, rest = take_option(args, "output_dir")
    output_dir = os.path.abspath(output_dir or _configured(rest, "output_dir")
                                 or os.path.join("outputs", f"{name}-{run_name}"))
    return output_dir, rest, claims(output_dir, run_name, rest)


def run_trl_command(command: str, launch_args: list[str], training_script_args: list[str],
                    job: orchestrators.Job | None) -> int:
    """``trl-ext <command>`` on a Ray Train worker group (``launching.trl_cli`` calls it in a Ray job's driver, after
    the input's checks): every worker runs the same command as one rank, with the accelerate config
    (``--accelerate_config``, ``--config_file``) applied in its process.

    Args:
        command: ``sft``, ``dpo``, ...
        launch_args: the accelerate launch options TRL's command line gathered.
        training_script_args: the script's options.
        job: the Ray job, or None.

    Returns:
        The driver's exit code.
    """
    from trl_ext.launching.launch import take_option

    placement = [name for name in _PLACEMENT if any(a == f"--{name}" or a.startswith(f"--{name}=")
                                                    for a in launch_args)]
    if placement:
        raise UsageError(f"--{placement[0]}: on Ray, Ray places the workers; drop it (--num_processes N or MIN-MAX "
                         "sets how many).")
    num_processes, launch_args = take_option(launch_args, "num_processes")
    config_file, _ = take_option(launch_args, "config_file")
    asked = cluster.parse_workers(num_processes)
    run_name = _run_name(job)
    output_dir, rest, claim = _run_output(training_script_args, command, run_name)
    task = Task(run=run_name, output_dir=output_dir, cwd=os.getcwd(), env=passed_on(), module="trl_ext",
                argv=[command, *rest, *(["--config_file", config_file] if config_file else []),
                      "--output_dir", output_dir], claim=claim)
    return _launch(task, asked)


def _run_name(job: orchestrators.Job | None) -> str:
    return job.run if job is not None and job.run else group.new_run_name()


def _launch(task: Task, asked: tuple[int, int] | None) -> int:
    """Connect, run the group, and end in one line.

    Returns:
        0; ``launching.restart.ERROR`` (201) for an error of the run's own; ``failure_limit.GAVE_UP`` (202) for
        more lost groups in a row without a new checkpoint than allowed; 1 for a group that could not start.
    """
    from trl_ext.launching import restart

    group.connect(None)
    try:
        result = group.run(task, asked, group.printer)
    except RunFailed as exc:
        group.printer(str(exc))
        return {"error": restart.ERROR, GAVE_UP: failure_limit.GAVE_UP}.get(exc.kind, 1)
    checkpoint = result.checkpoint.path if result.checkpoint is not None else None
    group.printer(f"Ray run {task.run} finished: {task.output_dir}"
                  + (f"; its newest checkpoint, registered with Ray: {checkpoint}" if checkpoint else ""))
    return 0


def claims(output_dir: str, run: str, rest: list[str]) -> bool:
    """Whether the driver makes ``output_dir`` the run's before Ray writes its own files there (``group.run``): yes
    for a new directory (or the run's own); another run's directory is refused, as the recipes refuse it, unless the
    command resumes or overwrites it, which the ranks then decide, as everywhere.

    Raises:
        UsageError: the directory holds another run's files.
    """
    if ownership.run_of(output_dir) == run:
        return True
    if "--overwrite_output_dir" in rest or any(a == "--resume_from_checkpoint" or
                                               a.startswith("--resume_from_checkpoint=") for a in rest):
        return False
    if os.path.isdir(output_dir) and os.listdir(output_dir):
        raise UsageError(f"output_dir '{output_dir}' already holds files from another run; nothing was changed. "
                         "Choose a new --output_dir, pass --resume_from_checkpoint true to continue that run, or "
                         "--overwrite_output_dir.")
    return True


def passed_on() -> dict[str, str]:
    """trl_ext's variables of the driver, for the workers (Ray gives them the job's runtime environment only)."""
    return {k: v for k, v in os.environ.items() if k.startswith("TRL_EXT_") and k not in _NOT_PASSED_ON}


def _configured(rest: list[str], key: str) -> str | None:
    """``key`` in the recipe config given with ``--config`` (if any)."""
    from trl_ext.launching.launch import read_config, take_option

    config, _ = take_option(rest, "config")
    value = read_config(config).get(key) if config else None
    return str(value) if value else None
