"""The `slurm` marker, the session's private Slurm cluster (`tests/slurm/cluster.py`), and the jobs that need nothing
but a free CPU, submitted together when the session starts so that they run beside the tests that wait (on a node, a
signal, a hold): on this 2-core host the leg's time is its waits, not its CPU."""


import pytest

from tests import deepspeed_op
from tests.slurm.cluster import SlurmCluster, missing_reason


def pytest_collection_modifyitems(items):
    # The node-loss tests kill node n2 and run last: no other test's job may be on n2 then.
    items.sort(key=lambda item: "test_node_loss" in item.nodeid)


def pytest_runtest_setup(item):
    # Skipped here rather than in the fixture: pytest reports a fixture's skip once per test, at the test's line, but
    # a hook's skip at the hook's line, so `-ra` prints one line for them all.
    if item.get_closest_marker("slurm") or "slurm_cluster" in getattr(item, "fixturenames", ()):
        reason = missing_reason()
        if reason:
            pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A started 2-node `SlurmCluster` for the whole session, stopped (every daemon and job process) at its end.

    Skips where Slurm is not installed, with one line saying how to get it (`.ci/slurm.sh`).
    """
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    # Four CPUs a node: jobs that wait (for a node, a signal, a hold) run beside each other. KillWait: a rank stopped by
    # SIGTERM saves its checkpoint within it even on this loaded host (seconds; a minute allowed), and no test waits for
    # it to run out. SlurmdTimeout: a killed node is marked DOWN (and its job requeued by Slurm) in 20-30 s instead of
    # 5 minutes, with room for a slow answer on this loaded host.
    with SlurmCluster(cpus_per_node=4, kill_wait=60, slurmd_timeout=20) as cluster:
        # DeepSpeed's CPU op, built once beforehand, in a directory of this environment's: other environments' builds
        # of it (with their own paths) would otherwise rebuild it under the jobs, and a kill mid-build would stall them.
        cluster.env["TORCH_EXTENSIONS_DIR"] = deepspeed_op.build()
        yield cluster


@pytest.fixture(scope="session")
def early(slurm_cluster, tmp_path_factory) -> dict:
    """The jobs that wait for nothing, submitted at once: name -> ``(job id, output directory)``. The 2-node ones are
    over before the node-loss tests (which wait for them); the others run on n1 only."""
    from tests.slurm import jobs

    tmp = tmp_path_factory.mktemp("slurm")
    on_n1 = {"nodes": 1, "sbatch": ["--nodelist=n1"]}
    specs = {
        "reference": (jobs.DPO, {}),  # every DPO run must end with this uninterrupted 2-node run's model
        "one-node": (jobs.DPO, on_n1),
        "fsdp2-two": (jobs.SFT_FSDP2, {}),
        "fsdp2-one": (jobs.SFT_FSDP2, on_n1),
        "ranged-reference": (jobs.RANGED_REFERENCE, on_n1),  # the node-range job's trajectory, uninterrupted
        "buggy": (*jobs.slowed(jobs.DPO, raise_at_step=5), on_n1),
    }
    submitted = {}
    for name, (args, *rest) in specs.items():
        env, options = (rest[0], rest[1]) if len(rest) == 2 else (None, rest[0])
        submitted[name] = (jobs.submit(slurm_cluster, tmp / name, args, env=env, **options), tmp / name)
    return submitted


@pytest.fixture(scope="session")
def reference(slurm_cluster, early):
    """The uninterrupted 2-node DPO run (`jobs.DPO`), finished: ``(output directory, log)``."""
    from tests.slurm.jobs import finished

    job, out = early["reference"]
    return out, finished(slurm_cluster, job, out)
