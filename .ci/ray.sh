#!/usr/bin/env bash
# The tests marked `ray` (tests/ray): a private 2-node Ray cluster on this host (`ray start --head` and a second
# node, each 2 logical CPUs and a temporary directory of its own), the recipes submitted with `ray job submit` and run
# through trl_ext.ray.fit, the second node killed and brought back; the cluster's processes are ended by their ids at
# the end. Ray comes with `.[test]` (`.[ray]` for users); without it this says so in one line and passes, as the tests
# would skip. Run from the README's test command, with the venv's python first on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import ray.train, ray.dashboard" 2>/dev/null; then
    echo "ray: skipped, Ray is not installed (pip install -e '.[ray]')"
    exit 0
fi
# DeepSpeed's CPU comm op, built now (another session beside this one may be building it: one waits for the other)
# rather than under the first job's timeout on a loaded machine
python -c "from tests import deepspeed_op; deepspeed_op.use_own_directory(); deepspeed_op.build()"
# Ray's daemons wait fixed times for each other at start (15 s, 30 s, and 60 s for the dashboard: tests/ray/cluster.py
# sets that one to 900 s), which they missed on 2 cores while the other legs' pip installs ran (2026-12-02, twice):
# the cluster starts once no install (pip's or uv's) runs on this machine, or after 45 minutes.
for _ in $(seq 540); do
    pgrep -f "pip install" >/dev/null || break
    sleep 5
done
python -m pytest -m ray "$@"
