"""The `slurm` marker and the session's private Slurm cluster (`tests/slurm/cluster.py`)."""

import pytest

from tests.slurm.cluster import SlurmCluster, missing_reason


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
    with SlurmCluster(kill_wait=10) as cluster:  # a stopped rank's save takes seconds here
        yield cluster
