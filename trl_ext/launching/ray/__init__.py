"""The Ray job's process roles: the driver (``recipe``: a recipe started by ``ray job submit``; ``fit`` from Python),
the worker group it starts (``group``, sized by ``cluster``, grown by ``growth``), the controller's verdict on a
failure (``controller``, ``failures``; a lost node reported dead to Ray by ``node_death``), and each worker's rank
(``worker``), which reports to Ray (``reporting``). Importing this package does not import Ray; calling into it does.
The public face is ``trl_ext.ray`` (docs/ray.md)."""


def fit(train, output_dir: str, *args, accelerate_config: str | None = None,
        num_workers: int | tuple[int, int] | str | None = None, max_failures: int | None = None,
        run: str | None = None, address: str | None = None, wait: float | None = None):
    """Run ``train(output_dir, *args)`` on a Ray Train worker group, each worker one rank, and return Ray's result.

    Each worker is the rank ``accelerate launch --config_file accelerate_config`` would start: the engine, the
    DeepSpeed or FSDP2 settings and the mixed precision of the config are applied in its process before ``train``
    runs; without a config, data parallel. A lost worker or node restarts the group (``max_failures`` times), which
    resumes from the run's newest committed checkpoint in ``output_dir`` by itself, at the number of workers it got
    and the same global batch; an error raised in ``train`` ends the run at once. With a range of workers, the group
    grows again when nodes join, after saving a checkpoint.

    Args:
        train: a function, picklable by Ray (defined in a module or the notebook), that builds a trl_ext trainer
            whose ``output_dir`` is ``output_dir``, trains and returns something small (rank 0's is returned).
        output_dir: the run's output directory, on storage every node sees (a shared file system): Ray's storage for
            the run, where every committed checkpoint is registered with Ray without a copy.
        *args: more arguments for ``train``.
        accelerate_config: an accelerate config (``accelerate_configs/zero3.yaml``), or None for data parallel.
        num_workers: a number, or ``(MIN, MAX)`` (or ``"MIN-MAX"``) for an elastic group; default one per GPU of the
            cluster, 2 per node without GPUs.
        max_failures: lost worker groups in a row without a new committed checkpoint that the run survives (default
            ``TRL_EXT_MAX_FAILURES``, else the former ``TRL_EXT_RAY_MAX_FAILURES``, else 3).
        run: the run's identity (default: the Ray job's, else a new one); the same identity resumes the same run.
        address: the cluster (default ``RAY_ADDRESS``, else the one started on this machine).
        wait: seconds to wait for the cluster to have room for the minimum (default ``TRL_EXT_RAY_WAIT_S``, else 300).

    Returns:
        Ray's ``ray.train.Result``: ``return_value`` (rank 0's), ``checkpoint`` (the newest committed one, in
        ``output_dir``), ``metrics``, ``metrics_dataframe``.

    Raises:
        trl_ext.errors.RunFailed: an error of the run's own (``kind`` "error"), more lost groups in a row without a
            new checkpoint than ``max_failures`` (``kind`` "gave-up"), or a group that could not start.
        UsageError: no cluster at the address, or too few resources for the minimum after ``wait``.
    """
    import os

    from trl_ext.launching.ray import cluster, group, recipe
    from trl_ext.launching.ray.worker import Task
    from trl_ext.placement import orchestrators

    if isinstance(num_workers, int):
        num_workers = str(num_workers)
    elif isinstance(num_workers, tuple):
        num_workers = f"{num_workers[0]}-{num_workers[1]}"
    asked = cluster.parse_workers(num_workers)
    group.connect(address)
    job = orchestrators.current()
    run = run or (job.run if job is not None and job.run else group.new_run_name())
    output_dir = os.path.abspath(output_dir)
    from trl_ext.launching.launch import DATA_PARALLEL

    task = Task(run=run, output_dir=output_dir, cwd=os.getcwd(), env=recipe.passed_on(), function=train, args=args,
                accelerate_config=os.path.abspath(accelerate_config or DATA_PARALLEL),
                claim=recipe.claims(output_dir, run, []))
    return group.run(task, asked, group.printer, max_failures=max_failures, wait=wait)


__all__ = ["fit"]
