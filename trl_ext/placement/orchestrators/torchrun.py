"""torchrun's variables, as it sets them for each rank it starts (``accelerate launch``, TorchElastic, a Ray Train
worker and the notebook launcher set the same ones): the rank, the world, the machines of this round, the rendezvous,
its run id and restart count; and what a launch of torchrun is given or cleared of."""

from trl_ext.errors import UsageError
from trl_ext.placement.orchestrators.job import Job, integer, value

# The launcher's own variables: a new launch must start from a clean slate. torchrun reads PET_<OPTION> as its options,
# so a Kubernetes pod's PET_NNODES would turn a launch on this machine into a wait for other machines.
LAUNCHER_PREFIXES = ("TORCHELASTIC_", "PET_")
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# torchrun's agents keep their TCP store to themselves: shared with the ranks, a restarted attempt's ranks read the
# previous attempt's addresses (pytorch#135712)
UNSHARED_STORE = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
# torchrun's own handlers (torch >= 2.6 reads this): not SIGTERM, which the ranks handle with a checkpoint
SIGNALS_OPTION = ("PET_SIGNALS_TO_HANDLE", "SIGINT,SIGHUP,SIGQUIT")
# The nodes' torchrun agents meet at their end in an exit barrier hosted by the first node's agent, which leaves as soon
# as the barrier is complete; another node's agent still waiting for the answer may then log "Error waiting on exit
# barrier" with a traceback, harmless. trl_ext's own lines say how the ranks ended, so the agents' own log (read from
# LOGLEVEL by torch's elastic package only) is kept to the critical, unless the user set LOGLEVEL.
AGENT_LOG_LEVEL = ("LOGLEVEL", "CRITICAL")


def started_a_rank() -> bool:
    """Whether torchrun (or a launcher that sets its variables) started this process as one rank: ``RANK``,
    ``WORLD_SIZE`` and ``LOCAL_RANK``. A PyTorchJob pod's own ``RANK`` and ``WORLD_SIZE`` (its index and the pod count,
    without ``LOCAL_RANK``) are not a rank's."""
    return bool(value("RANK") and value("WORLD_SIZE") and value("LOCAL_RANK"))


def read(outer: Job | None) -> Job | None:
    """A rank started by torchrun (also inside ``accelerate launch``), its run and restarts those of the orchestrator
    around it (``outer``), if any.

    Args:
        outer: the job of the orchestrator around torchrun (the node launcher's, passed down), or None.

    Returns:
        The rank's job, or None when torchrun did not start this process.
    """
    if not started_a_rank():
        return None
    world = integer("WORLD_SIZE", value("WORLD_SIZE"), minimum=1)
    rank = integer("RANK", value("RANK"))
    if rank >= world:
        raise UsageError(f"RANK={rank} is beyond WORLD_SIZE={world}; check the launcher's environment.",
                         every_rank=True)
    nodes = int(value("GROUP_WORLD_SIZE") or 1)
    run_id = value("TORCHELASTIC_RUN_ID")
    run = outer.run if outer is not None and outer.run else (
        f"torchrun-{run_id}" if run_id and run_id != "none" else None)
    restart = int(value("TORCHELASTIC_RESTART_COUNT") or 0) + (outer.restart if outer is not None else 0)
    around = {} if outer is None else {"job_id": outer.job_id, "hosts": outer.hosts, "host": outer.host,
                                       "node_launched": outer.node_launched}
    return Job(outer.orchestrator if outer is not None else "torchrun", per_rank=True, nodes=nodes,
               node_rank=int(value("GROUP_RANK") or 0), address=value("MASTER_ADDR"),
               port=int(value("MASTER_PORT")) if value("MASTER_PORT") else None,
               per_node=int(value("LOCAL_WORLD_SIZE") or world), run=run, restart=restart, rank=rank, world_size=world,
               source="torchrun" if outer is None else f"{outer.source}; torchrun", **around)


def launched_rank() -> int:
    """This process's global rank as its launcher set it (0 outside a launch); readable before any process group."""
    return int(value("RANK") or 0)


def launched_world_size() -> int:
    """The number of processes its launcher started (1 outside a launch)."""
    return int(value("WORLD_SIZE") or 1)


def local_world_size() -> int | None:
    """The processes its launcher started on this machine, or None where it said nothing."""
    return int(value("LOCAL_WORLD_SIZE")) if value("LOCAL_WORLD_SIZE") else None


def restarts_share_store() -> bool:
    """Whether torchrun may restart this job (``--max-restarts``) while its agents share their TCP store with the
    ranks, which a restarted attempt's ranks then misread (pytorch#135712)."""
    restarts = value("TORCHELASTIC_MAX_RESTARTS") or "0"
    return (restarts.isdigit() and int(restarts) > 0 and value("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and value(UNSHARED_STORE[0]) != UNSHARED_STORE[1])


def is_launchers(name: str) -> bool:
    """Whether ``name`` is one of torchrun's variables, which a new launch must not inherit."""
    return name in LAUNCHER_VARIABLES or name.startswith(LAUNCHER_PREFIXES)


def machine_group(node_rank: int, nodes: int) -> dict[str, str]:
    """torchrun's names for this machine's place among the machines, for a rank another launcher started (a Ray Train
    worker) that trl_ext's readers then read as torchrun's.

    Args:
        node_rank: this machine's place.
        nodes: the number of machines.

    Returns:
        The variables to set.
    """
    return {"GROUP_RANK": str(node_rank), "GROUP_WORLD_SIZE": str(nodes)}
