"""Standby processes: a worker group that Ray Train restarts after a lost worker or node starts on processes that are
already up, with the ranks' libraries imported.

Ray Train ends every worker of a lost group and starts new ones, and each new Python process imports Ray, torch,
transformers and TRL before its first step: 24.6 s of a 29.7-s recovery on this 2-core machine (bench/RESULTS.md).
So once a group has taken its first step, each node asks its raylet for as many spare workers for the run as the group
has ranks there (Ray's own pool of idle workers, bound to the job and to the workers' runtime environment: patch
``ray-standby-workers``). Each spare imports, in order, the modules a rank of the group had imported (Ray's setup
hook, ``preload``), then waits. Ray gives the next group's workers these processes first: a recovery took 9.6 s with
them, 27.3 s without (bench/RESULTS.md).

- Only spares import in the hook: each claims one of the slots that the request writes in a node-local directory.
  A group's own start is not held by imports, which would count in Ray Train's start timeout.
- GPU groups preload torch only: an import that initialized CUDA before Ray hands the process its GPU
  (``CUDA_VISIBLE_DEVICES``) would leave it seeing every GPU.
- Off with ``TRL_EXT_RAY_STANDBY=0``, and where the job has a setup hook of its own (Ray allows one).
- Ray ends a job's spares with the job.
"""

import os
import sys
import tempfile
import time
from pathlib import Path

from trl_ext import patches
from trl_ext.errors import SetupError
from trl_ext.settings import environment

HOOK = "trl_ext.launching.ray.standby.preload"
HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"  # Ray's variable for a setup hook (ray_constants)
KEEP_ALIVE_S = 30 * 24 * 3600  # the raylet keeps a spare this long; the job's end ends it first
SLOT, SPARE = "slot-", "spare-"  # a spare to be started; a started spare, by its process id
GPU_PRELOAD = ("torch",)


def enabled() -> bool:
    """On the driver: whether the run keeps standby processes: ``TRL_EXT_RAY_STANDBY`` (default 1), no setup hook of
    the job's own, and a Ray release where the patch applies. Its workers then run with the hook (``worker_env``)."""
    if environment.RAY_STANDBY.whole(0, 1) == 0 or HOOK_ENV in os.environ:
        return False
    if not patches.applies("ray-standby-workers"):
        return False
    from ray._private import ray_constants

    return ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR == HOOK_ENV


def worker_env() -> dict[str, str]:
    """The variables the worker group's runtime environment adds (``RunConfig(worker_runtime_env=...)``): the setup
    hook, where standby processes are on; else none."""
    return {HOOK_ENV: HOOK} if enabled() else {}


def preload() -> None:
    """Ray's setup hook, run in each new worker process of the group's runtime environment before it takes work: a
    spare (a process that claims a slot) imports what the slot names; any other process returns at once. Never
    raises: Ray ends a worker whose hook fails."""
    try:
        slot = _claim()
        if slot is None:
            return
        # At the priority of any worker: a group restarted while a spare still imports waits for it no longer than
        # for a new process (at a lower one, seen in CI at load 10, it waited minutes)
        started = time.monotonic()
        failed = _import(slot.read_text().split())
        slot.write_text(f"{time.monotonic() - started:.1f} {failed}")
    except Exception:  # noqa: BLE001 - a spare that failed to preload is still a worker
        pass


def taken() -> float | None:
    """Called where a rank starts: if this process is a spare, it is one no longer (its slot is removed).

    Returns:
        The seconds its imports took before it was taken, or None if it is no spare.
    """
    directory = _directory()
    spare = directory / f"{SPARE}{os.getpid()}" if directory else None
    if spare is None or not spare.exists():
        return None
    try:
        seconds = float(spare.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        seconds = 0.0  # still importing, or its file was not written yet
    spare.unlink(missing_ok=True)
    return seconds


def keep_ready(ranks: int, gpu: bool, say) -> int:
    """On one rank of a node: top up the node's spares to ``ranks`` (those still waiting are counted).

    Args:
        ranks: the group's ranks on this node.
        gpu: whether the group's workers use GPUs (then spares import torch only).
        say: prints one line.

    Returns:
        How many spares were asked for.
    """
    directory = _directory()
    if directory is None or os.environ.get(HOOK_ENV) != HOOK:  # the driver did not turn them on (``worker_env``)
        return 0
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f"{SLOT}*"):  # a slot no spare claimed: asked for by a group that is gone
        stale.unlink(missing_ok=True)
    waiting = 0
    for spare in directory.glob(f"{SPARE}*"):
        if _alive(int(spare.name[len(SPARE):])):
            waiting += 1
        else:
            spare.unlink(missing_ok=True)
    wanted = ranks - waiting
    if wanted <= 0:
        return 0
    modules = GPU_PRELOAD if gpu else imported()
    for index in range(wanted):
        (directory / f"{SLOT}{time.time_ns()}-{index}").write_text("\n".join(modules))
    try:
        _prestart(wanted)
    except Exception as exc:  # noqa: BLE001 - the group restarts on new processes, as without spares
        say(f"Ray: could not ask this node's raylet for standby processes ({type(exc).__name__}: {exc})")
        return 0
    what = "torch imported" if gpu else f"{len(modules)} modules imported as a rank had them"
    say(f"Ray: {wanted} standby process(es) on this node ({what}), for a restarted worker group to start on; "
        f"{environment.RAY_STANDBY.name}=0 turns them off")
    return wanted


def after_first_step(ranks: int, gpu: bool, say):
    """A trainer callback that calls ``keep_ready`` once, after the trainer's first step: the node's spares import
    then, beside training, not while the ranks start.

    Args:
        ranks: the group's ranks on this node.
        gpu: whether the group's workers use GPUs.
        say: prints one line.

    Returns:
        A ``TrainerCallback`` (transformers is imported here, not with this module, which every worker's hook
        imports).
    """
    from transformers import TrainerCallback

    class KeepReady(TrainerCallback):
        asked = False

        def on_step_end(self, args, state, control, **kwargs):
            if not self.asked:
                self.asked = True
                keep_ready(ranks, gpu, say)

    return KeepReady()


def imported() -> list[str]:
    """The modules this process has imported, in the order it imported them, that a spare can import again: those
    from files (not ``__main__``, not the recipe run as it)."""
    names = []
    for name, module in list(sys.modules.items()):
        if name.startswith("__") or module is None or not getattr(module, "__file__", None):
            continue
        if getattr(module, "__spec__", None) is None:
            continue
        names.append(name)
    return names


def _import(names: list[str]) -> int:
    """Imports each of ``names`` in order; returns how many failed (the rank imports each again if it needs it)."""
    import importlib

    failed = 0
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - SystemExit from a module's import included; the rank decides
            failed += 1
    return failed


def _claim() -> Path | None:
    """This process's slot, claimed (renamed to ``spare-<pid>``) if one waits in the node's directory, else None."""
    directory = _directory()
    if directory is None or not directory.is_dir():
        return None
    mine = directory / f"{SPARE}{os.getpid()}"
    for slot in sorted(directory.glob(f"{SLOT}*")):
        try:
            os.rename(slot, mine)  # atomic: one process gets each slot
        except OSError:
            continue
        return mine
    return None


def _directory() -> Path | None:
    """The directory of this job's spares on this node, or None outside a Ray process."""
    try:
        import ray

        if not ray.is_initialized():  # get_runtime_context() would start a local Ray instance
            return None
        context = ray.get_runtime_context()
        job, node = context.get_job_id(), context.get_node_id()
    except Exception:  # noqa: BLE001 - not in a Ray process
        return None
    # the node's id too: nodes that share a machine (tests, bench/) keep their spares apart, as machines do
    return Path(tempfile.gettempdir()) / "trl_ext-ray-standby" / job / node[:16]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _prestart(count: int, timeout: float = 10.0) -> None:
    """Asks this node's raylet to start ``count`` workers for this job and this worker's runtime environment (patch
    ``ray-standby-workers``)."""
    if not patches.applies("ray-standby-workers"):
        raise SetupError("this Ray release has no PrestartWorkers call as trl_ext knows it")
    import ray
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc, runtime_environment_pb2

    context = ray.get_runtime_context()
    node = next(n for n in ray.nodes() if n["NodeID"] == context.get_node_id())
    request = node_manager_pb2.PrestartWorkersRequest(
        language=common_pb2.PYTHON, job_id=bytes.fromhex(context.get_job_id()),
        runtime_env_info=runtime_environment_pb2.RuntimeEnvInfo(
            serialized_runtime_env=context.get_runtime_env_string()),
        keep_alive_duration_secs=KEEP_ALIVE_S, num_workers=count)
    channel = init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
    try:
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=timeout)
    finally:
        channel.close()
