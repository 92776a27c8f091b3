#!/usr/bin/env bash
# The oldest-versions leg (.ci/oldest.sh) and the Slurm leg (.ci/slurm.sh) side by side: the Slurm leg mostly waits
# (on signals, holds, a lost node's timeout) and the oldest leg is mostly one in-process pytest, so on 2 cores the two
# together take about as long as the Slurm leg alone. Each leg's output goes to its own log, printed when it ends;
# the exit code is the first failing leg's. Run from the README's test command, with the venv's python first on PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=$(mktemp -d)
.ci/oldest.sh "$@" > "$logs/oldest.log" 2>&1 &
oldest=$!
.ci/slurm.sh "$@" > "$logs/slurm.log" 2>&1
slurm=$?
wait "$oldest"
oldest_status=$?
echo "=== .ci/oldest.sh (exit $oldest_status)"; cat "$logs/oldest.log"
echo "=== .ci/slurm.sh (exit $slurm)"; cat "$logs/slurm.log"
rm -rf "$logs"
[ "$oldest_status" -ne 0 ] && exit "$oldest_status"
exit "$slurm"
