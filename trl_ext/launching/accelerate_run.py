"""``python -m trl_ext.launching.accelerate_run <accelerate launch arguments>``: accelerate's own launch, as a recipe's
re-launch and the node launcher run it, ending with its ranks' exit code instead of torchrun's report of it.

A rank that refuses its input says so in one line and exits with 1; a rank that fails prints its own traceback.
torchrun then raises ``ChildFailedError`` in the launching process, whose traceback and summary add a screenful that
says nothing more. Here that exception ends the process quietly with the failed rank's exit code, and a rank killed by
a signal (the OOM killer's SIGKILL) is said in one line, since that rank could not say it itself.

``run_torchrun`` runs torchrun itself the same way: an elastic job's machine (``launching.elastic``), whose range of
machines accelerate's launch cannot take.
"""

import signal
import sys


def run(args) -> int:
    """Run ``accelerate launch`` in this process.

    Args:
        args: ``accelerate launch``'s parsed arguments (``launch_command_parser().parse_args(...)``).

    Returns:
        0, or the first failed rank's exit code (128 + the signal for a rank killed by one).
    """
    from accelerate.commands.launch import launch_command

    if getattr(args, "max_restarts", 0) and int(args.num_machines or 1) <= 1:
        # One machine that restarts its ranks: a rendezvous of its own each round (torchrun's --standalone). The
        # static one reuses the round before's store, and a restarted rank then waited for the lost rank's address
        # (measured: the first restart failed, timed out connecting).
        args.standalone = True
    return _ranks_exit_code(launch_command, args)


def run_torchrun(argv: list[str]) -> int:
    """Run torchrun in this process, as ``run`` runs ``accelerate launch``.

    Args:
        argv: torchrun's arguments.

    Returns:
        0, or the first failed rank's exit code (128 + the signal for a rank killed by one).
    """
    from torch.distributed import run as torchrun

    return _ranks_exit_code(torchrun.run, torchrun.parse_args(argv))


def _ranks_exit_code(launch, args) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        launch(args)
    except ChildFailedError as exc:
        rank, failure = _cause(exc.failures) if exc.failures else (0, None)
        code = failure.exitcode if failure is not None else 1
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            hint = " (the OOM killer's, if nothing else sent it)" if -code == signal.SIGKILL else ""
            print(f"[trl_ext] rank {rank} was killed by {name}{hint}", file=sys.stderr, flush=True)
            return 128 - code
        return code or 1
    return 0


def _cause(failures: dict) -> tuple:
    """The failure that ended the run: once one rank fails, torchrun ends the others with SIGTERM, and they can be
    recorded in the same second (its timestamps are whole seconds). So a rank's own exit code first, then another
    signal (the OOM killer's), then SIGTERM; the earliest, then the lowest rank."""
    def order(item):
        rank, failure = item
        code = failure.exitcode
        return (0 if code > 0 else 2 if code == -signal.SIGTERM else 1), failure.timestamp, rank

    return min(failures.items(), key=order)


def main(argv: list[str] | None = None) -> int:
    """``run`` with ``argv`` (default: the command line) as ``accelerate launch`` parses it."""
    from accelerate.commands.launch import launch_command_parser

    return run(launch_command_parser().parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
