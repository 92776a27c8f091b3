"""``trl-ext sft|dpo|reward|kto|grpo|rloo``: TRL's command line with trl_ext's trainers.

The command is TRL's own (``trl.cli``): the same parser, config files, ``accelerate launch`` options and
``--accelerate_config`` presets. Two things differ, each a declared patch: TRL's launcher starts trl_ext's runner
(``trl_script.py``) instead of ``trl/scripts/<name>.py``, and the runner runs that same script with
``trl.<Name>Trainer`` and ``trl.<Name>Config`` resolving to trl_ext's classes. Before anything is launched, the model
and the dataset are checked as the recipes check them.
"""

import contextlib
import functools
import os
import sys
from argparse import Namespace
from pathlib import Path

from trl_ext import patches, trainers

# command -> the prefix of its trainer and config classes in `trl` and `trl_ext`: one per registered trainer
COMMANDS = trainers.commands()
RUNNER = Path(__file__).with_name("trl_script.py")


@contextlib.contextmanager
def trl_ext_classes(command: str):
    """Inside the block, ``from trl import <Name>Trainer, <Name>Config`` gives trl_ext's classes (patch
    ``trl-script-classes``).

    Args:
        command: a key of ``COMMANDS``.
    """
    import trl

    import trl_ext

    prefix = COMMANDS[command]
    with contextlib.ExitStack() as stack:
        for name in (f"{prefix}Trainer", f"{prefix}Config"):
            stack.enter_context(patches.swapped("trl-script-classes", trl, name, getattr(trl_ext, name)))
        yield


def _check_before_launch(command: str, training_script_args: list[str]) -> None:
    """The model and the dataset, checked as the recipes check them, before any process starts (one line and exit
    code 1 on a problem). The dataset is loaded as TRL's script loads it; mixtures and streamed datasets are left to
    the script."""
    from datasets import load_dataset

    from trl_ext.launching import rename_probe, scripting

    script = __import__(f"trl.scripts.{command}", fromlist=["make_parser"])
    parsed = script.make_parser().parse_args_and_config(training_script_args, fail_with_unknown_args=False)
    script_args, training_args, model_args = parsed[:3]
    dataset_args = parsed[3] if len(parsed) > 3 and hasattr(parsed[3], "datasets") else None
    scripting.check_model(model_args.model_name_or_path)
    if training_args.output_dir:
        rename_probe.check_renames(training_args.output_dir)
    scripting.check_mirror(training_args)
    if (dataset_args is not None and dataset_args.datasets) or script_args.dataset_streaming:
        return
    kind = trainers.trainer_for(command)._dataset_kind  # None: prompts, which only the trainer interprets
    scripting.check_dataset(script_args, training_args, model_args, command, kind,
                            load=lambda name, config: load_dataset(name, name=config))


def _embedded_as_paths(command: str, training_script_args: list[str]) -> list[str]:
    """The arguments with an embedded model's or dataset's name (``trl-ext/tiny-llama-arith``,
    ``trl-ext/arithmetic-preference``) given again as its local path, last (the last value wins, over a config file's
    too): TRL's script in every rank then loads what the check before the launch loaded, as it loads any local path."""
    from trl_ext.assets import resolve_model
    from trl_ext.assets.datasets import embedded_dataset_dir

    script = __import__(f"trl.scripts.{command}", fromlist=["make_parser"])
    parsed = script.make_parser().parse_args_and_config(training_script_args, fail_with_unknown_args=False)
    script_args, model_args = parsed[0], parsed[2]
    extra = []
    model = getattr(model_args, "model_name_or_path", None)
    if model and resolve_model(model) != model:
        extra += ["--model_name_or_path", resolve_model(model)]
    dataset = getattr(script_args, "dataset_name", None)
    if dataset and (directory := embedded_dataset_dir(dataset)):
        extra += ["--dataset_name", directory]
    return [*training_script_args, *extra]


def _launch_runner(script_name: str, launch_args: list[str], training_script_args: list[str], *, job, decision,
                   **kwargs) -> None:
    """TRL's ``launch_training_script``, launching trl_ext's runner of the same script as ``decision`` says
    (``launching.decision``, made once by ``trl_ext.cli``): in a rank that torchrun started (``torchrun -m trl_ext sft
    ...``, as Kubeflow's TRL runtime runs TRL's scripts), the script runs in this process, with the accelerate config
    (``--accelerate_config``, ``--config_file``) applied here; a Ray job's driver hands it to a worker group; else
    accelerate's launch starts the ranks, with the orchestrator's machines under the node launcher."""
    from trl_ext.launching import launch
    from trl_ext.launching.decision import Become, handed_down
    from trl_ext.process import notice

    command = script_name.removesuffix(".py")
    training_script_args = _embedded_as_paths(command, training_script_args)
    _check_before_launch(command, training_script_args)
    num_processes, _ = launch.take_option(launch_args, "num_processes")
    if decision.become is Become.RAY_DRIVER:  # a Ray job's driver: a worker group
        launch._exec([sys.executable, "-m", "trl_ext.ray", "trl-ext", command, *launch_args, "--",
                      *training_script_args], handed_down(Become.RAY_DRIVER), strip_launcher=False)
    if decision.become is Become.RANK and job is not None and job.per_rank:
        config_file, _ = launch.take_option(launch_args, "config_file")
        applied = ""
        if config_file:
            from trl_ext.launching import in_process

            applied = f"; {config_file} applied in each process ({in_process.apply(config_file, job)})"
        if decision.started_by not in launch.RELAUNCHES:
            notice(f"{job.describe()}{applied}")
        _run_in_this_process(command, training_script_args)
        return
    from accelerate.commands.launch import launch_command_parser

    from trl_ext.launching import accelerate_run

    if decision.become is Become.MACHINE:  # the orchestrator's machines
        machines, line = launch.machine_args(job, int(num_processes) if num_processes else None)
        launch_args = [*launch_args, *machines]  # later options win
        notice(line)
    os.environ.update(handed_down(Become.MACHINE if decision.become is Become.MACHINE else Become.ACCELERATE))
    code = accelerate_run.run(launch_command_parser().parse_args([*launch_args, str(RUNNER), command,
                                                                  *training_script_args]))
    if code:
        sys.exit(code)


def _run_in_this_process(command: str, training_script_args: list[str]) -> None:
    """TRL's ``trl/scripts/<command>.py`` run as ``__main__`` here, as the runner runs it in a launched process."""
    import runpy

    argv = sys.argv
    sys.argv = [str(RUNNER), *training_script_args]
    try:
        runpy.run_module(f"trl.scripts.{command}", run_name="__main__", alter_sys=True)
    finally:
        sys.argv = argv


def run(command: str, argv: list[str], job=None, decision=None) -> int:
    """Run ``trl <command> <argv>`` with trl_ext's trainers.

    Args:
        command: a key of ``COMMANDS``.
        argv: everything after the command, as ``trl`` takes it.
        job: this process's job (default: read now).
        decision: what this process becomes (``launching.decision``; default: decided now).

    Returns:
        The exit code (0; a failed launch raises, as under ``trl``).
    """
    from trl.cli import accelerate_launcher
    from trl.cli.commands.base import CommandContext
    from trl.cli.commands.training import TrainingCommand

    from trl_ext.launching.decision import decide
    from trl_ext.placement import orchestrators

    if decision is None:
        job = orchestrators.current()
        decision = decide(job, accelerate=True)
    runner = functools.partial(_launch_runner, job=job, decision=decision)
    with (trl_ext_classes(command),
          patches.swapped("trl-cli-script", accelerate_launcher, "launch_training_script", runner)):
        return TrainingCommand(command).run(Namespace(command=command), CommandContext(argv=[command, *argv]))
