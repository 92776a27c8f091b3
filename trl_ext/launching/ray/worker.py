"""What each worker of a trl_ext Ray Train worker group runs: one rank, the same rank ``accelerate launch`` would start.

Ray's torch backend has set the rank's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``...) and
created the process group. Here the worker then:

1. takes the driver's working directory (where the recipe's relative paths point; Ray Train moves each worker to a
   directory of its own) and trl_ext's variables (``TRL_EXT_*``);
2. counts this group among the run's groups (the run's record in its output directory, read on rank 0): the
   restart number;
3. hands the rank its job (``placement.orchestrators``, through ``TRL_EXT_NODE``): orchestrator "Ray", the run's
   identity, the restart, so that the rank trains as a torchrun rank would, with the accelerate config applied in
   this process, and a restarted group resumes from the run's newest committed checkpoint by itself;
4. gives every trainer it builds what Ray sees of the run (``reporting``), in an elastic group short of its maximum
   a watch for nodes that join (``growth``), and on each node's first rank the node's standby processes, asked for
   after the first step (``standby``: a restarted group starts on them; rank 0 says which ranks did);
5. runs the recipe (as ``python recipe.py ...`` would, ``__main__``), ``trl-ext <command>``, or the function given to
   ``trl_ext.ray.fit``;
6. ends: with the function's value; after a planned stop for growth, with ``{GROW: step}``; or by raising what ended
   the rank as an ``errors.RankError`` that says whether a restart can help.
"""

import os
import runpy
import sys
import traceback
from dataclasses import dataclass, field, replace

from trl_ext.launching.ray import standby
from trl_ext.launching.ray.failures import RankError, first_line
from trl_ext.placement import orchestrators, outcome, ownership
from trl_ext.process.collectives import from_every_rank, max_over_ranks
from trl_ext.process.hosted import HOSTED

GROW = "trl_ext_grow"  # in rank 0's return value: the group stopped at this step to restart on more workers
GROUPS = "groups"  # in the run's record (placement.ownership): how many worker groups the run has started


@dataclass
class Task:
    """What the driver sends every worker.

    Args:
        run: the run's identity.
        output_dir: the run's output directory (absolute; Ray's storage for the run).
        cwd: the driver's working directory.
        env: variables to set in the worker (trl_ext's own).
        script: a recipe's path, run as ``__main__`` with ``argv``; or
        module: a module run as ``__main__`` with ``argv`` (``trl_ext``: ``trl-ext <command>``); or
        function: called as ``function(output_dir, *args)`` (``trl_ext.ray.fit``).
        argv: the script's or module's arguments.
        args: the function's other arguments.
        accelerate_config: applied in this process before ``function`` (a recipe applies its own ``--config``).
        most: the elastic range's maximum (0: a fixed size): below it, the group watches for nodes that join.
        per_worker: each worker's resources, to tell whether a joining node has room for more.
        claim: the driver marks ``output_dir`` as the run's before the first group starts (``recipe.claims``).
    """

    run: str
    output_dir: str
    cwd: str
    env: dict = field(default_factory=dict)
    script: str | None = None
    module: str | None = None
    function: object = None
    argv: list = field(default_factory=list)
    args: tuple = ()
    accelerate_config: str | None = None
    most: int = 0
    per_worker: dict = field(default_factory=dict)
    claim: bool = True


def train(config: dict):
    """The worker group's training function (``TorchTrainer(train, train_loop_config={"task": task})``).

    Args:
        config: ``{"task": Task}``.

    Returns:
        The function's value (a recipe's: None), or ``{GROW: step}`` after a planned stop for growth.

    Raises:
        RankError: what ended this rank, with its kind.
    """
    import ray
    import ray.train

    task: Task = config["task"]
    context = ray.train.get_context()
    rank = context.get_world_rank()
    spare = standby.taken()
    _enter(task)
    job = _job(task, context)
    # each rank's Ray node (Ray Train's local ranks count a machine's, and nodes can share one) and whether it started
    # on a standby process
    views = from_every_rank((ray.get_runtime_context().get_node_id(), spare))
    _say_spares([seconds for _, seconds in views], rank)
    here = [r for r, (node, _) in enumerate(views) if node == views[rank][0]]
    from trl_ext.launching.ray import growth, reporting
    from trl_ext.trainers.components import joining

    built = []

    def report(trainer) -> None:
        built.append(trainer)
        reporting.RayReport.join(trainer)

    def grow(trainer) -> None:
        trainer.join(growth.Growth(trainer, context.get_world_size(), task.most, task.per_worker))

    def spares(trainer) -> None:  # the node's first rank keeps a spare ready for each of its ranks (``standby``)
        trainer.join(standby.after_first_step(len(here), bool(task.per_worker.get("GPU")), _say))

    grows = task.most > context.get_world_size() and rank == 0
    own = [*([grow] if grows else []), *([spares] if here[0] == rank else [])]
    try:
        with joining(report, *own):  # every trainer the run builds (step 4 above)
            value = _run(task, job)
    except BaseException as exc:  # noqa: BLE001 - every ending is told to Ray, as a value or as a RankError
        stopped = [t.state.global_step for t in built if t.preemption is not None and t.preemption.stopping]
        if isinstance(exc, SystemExit) and stopped:  # the planned stop: every rank agreed on it, with a checkpoint
            reporting.flush()
            return {GROW: stopped[-1]}
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            value = None
        else:
            raise _failure(exc, rank) from None
    reporting.flush()
    return value


def _say_spares(seconds: list, rank: int) -> None:
    """Rank 0 says which ranks started on standby processes (``standby``), if any did."""
    ranks = [str(r) for r, s in enumerate(seconds) if s is not None]
    if rank == 0 and ranks:
        done = max(s for s in seconds if s is not None)
        _say(f"Ray: rank(s) {', '.join(ranks)} of {len(seconds)} started on standby processes, their imports done "
             f"before (at most {done:.1f} s each)")


def _say(line: str) -> None:
    print(f"[trl_ext] {line}", flush=True)


def _enter(task: Task) -> None:
    if os.path.isdir(task.cwd):
        os.chdir(task.cwd)
    os.environ.update(task.env)
    os.environ[HOSTED] = "1"  # end_together returns; Ray ends this process


def _job(task: Task, context) -> orchestrators.Job:
    """This rank's view of the run (``TRL_EXT_NODE``), its restart counted on rank 0 in the run's record and given to
    every rank."""
    from trl_ext.process.collectives import decided_on_rank0

    node_rank = context.get_node_rank()
    nodes = _nodes(node_rank)
    job = orchestrators.Job("Ray", per_rank=False, nodes=nodes, node_rank=node_rank, run=task.run,
                            source="Ray Train")
    os.environ.update(job.handed_down())
    os.environ.update(orchestrators.torchrun.machine_group(node_rank, nodes))  # as torchrun names them

    def count() -> int:
        started = int(ownership.record(task.output_dir).get(GROUPS, 0))
        ownership.update(task.output_dir, **{GROUPS: started + 1})
        return started

    job = replace(job, restart=decided_on_rank0(count))
    os.environ.update(job.handed_down())
    return job


def _nodes(node_rank: int) -> int:
    return max_over_ranks(node_rank) + 1


def _run(task: Task, job: orchestrators.Job):
    if task.function is not None:
        if task.accelerate_config:
            from trl_ext.launching import in_process
            from trl_ext.process.notices import notice

            notice(f"{job.describe()}; {task.accelerate_config} applied in each process "
                   f"({in_process.apply(task.accelerate_config, job)})")
        return task.function(task.output_dir, *task.args)
    path = task.script or task.module
    sys.argv = [path, *task.argv]
    if task.script:
        sys.path.insert(0, os.path.dirname(os.path.abspath(task.script)))  # as `python recipe.py` does
        runpy.run_path(task.script, run_name="__main__")
    else:
        runpy.run_module(task.module, run_name="__main__", alter_sys=True)
    return None


def _failure(exc: BaseException, rank: int) -> RankError:
    """The ``RankError`` for what ended this rank, its traceback (or a usage error's one line) printed first: Ray
    keeps only the error's text."""
    kind = outcome.kind_of(exc)
    if isinstance(exc, SystemExit):
        if rank == 0 or getattr(exc, "every_rank", False):
            print(str(exc) if str(exc) else f"exit {exc.code}", file=sys.stderr, flush=True)
    elif kind == outcome.ERROR or rank == 0:
        traceback.print_exception(exc, file=sys.stderr)
        sys.stderr.flush()
    return RankError(f"rank {rank}: {first_line(exc)}", kind=kind)
