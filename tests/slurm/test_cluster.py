"""The private Slurm cluster works as the recipe tests need: 2-node jobs, node addresses, requeue, clean teardown."""

import os
import re
from pathlib import Path

import pytest

from tests.slurm.cluster import MARKER_ENV, SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(120)]

TWO_NODES = r"""#!/bin/bash
set -euo pipefail
# Node names do not resolve as hosts here: the first node's address comes from its NodeAddr.
first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)
addr=$(scontrol show node "$first" -o | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
echo "first=$first addr=$addr"
srun --ntasks-per-node=1 bash -c \
    'echo "task nodeid=$SLURM_NODEID procid=$SLURM_PROCID nodelist=$SLURM_JOB_NODELIST node=$SLURMD_NODENAME"'
"""

# A loop, not `sleep 300 & wait`: Slurm signals the child a moment before the shell, and a child killed by that
# SIGTERM can end `wait`, and the script, before bash runs the trap (a few times in a hundred here).
REQUEUED = r"""#!/bin/bash
trap 'echo "run ${SLURM_RESTART_COUNT:-0} got TERM"; exit 143' TERM
echo "run ${SLURM_RESTART_COUNT:-0} job $SLURM_JOB_ID"
if [ -n "${SLURM_RESTART_COUNT:-}" ]; then exit 0; fi
while :; do sleep 1; done
"""


def test_two_node_job_runs_one_task_per_node(slurm_cluster):
    job = slurm_cluster.sbatch(["-N2", "--ntasks-per-node=1"], TWO_NODES, name="two-nodes")
    info = slurm_cluster.wait_state(job, "COMPLETED", timeout=30)
    out = slurm_cluster.output(job)
    tasks = sorted(re.findall(r"task nodeid=(\d) procid=(\d) nodelist=(\S+) node=(\S+)", out))
    assert tasks == [("0", "0", "n[1-2]", "n1"), ("1", "1", "n[1-2]", "n2")], out
    assert f"first=n1 addr={slurm_cluster.node_info('n1')['NodeAddr']}" in out
    assert "addr=127.0.0.1" in out
    assert info["NodeList"] == "n[1-2]"


def test_requeued_job_runs_again_with_restart_count(slurm_cluster):
    job = slurm_cluster.sbatch(["-N2", "--requeue", "--open-mode=append"], REQUEUED, name="requeue")
    slurm_cluster.wait_output(job, "run 0 job", timeout=30)
    slurm_cluster.requeue(job)
    slurm_cluster.start_now(job)  # once pending: no waiting cred_expire + 1 s
    info = slurm_cluster.wait_state(job, "COMPLETED", timeout=30, min_restarts=1)
    out = slurm_cluster.output(job)
    assert "run 0 got TERM" in out, out
    assert f"run 1 job {job}" in out, out
    assert info["Restarts"] == "1"


def test_stop_leaves_nothing_running(slurm_cluster):
    """A second cluster beside the session's (own ports, munged and name), stopped with a job that ignores SIGTERM
    still running: nothing it started survives, and its directory goes."""
    cluster = SlurmCluster(kill_wait=30).start()
    root, marker = cluster.root, f"{MARKER_ENV}={cluster.name}".encode()
    try:
        job = cluster.sbatch(["-N2"], "#!/bin/bash\ntrap '' TERM\nsrun -N2 sleep 300 &\necho up\nwait\n")
        cluster.wait_output(job, "up", timeout=30)
        cluster.wait_state(job, "RUNNING", timeout=30)
    finally:
        cluster.stop()
    assert not root.exists()
    survivors = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    survivors.append(entry.name)
        except OSError:
            continue
    assert survivors == []
