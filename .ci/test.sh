#!/usr/bin/env bash
# Every test: the main suite (`python -m pytest`, with this script's arguments) and, side by side with it from the
# start, the oldest-versions leg (.ci/oldest.sh) and the Slurm leg (.ci/slurm.sh). On 2 cores they share the machine:
# the main suite leaves a core idle while its launches start, and while they wait on servers, kills and time bounds;
# the oldest leg installs, then runs one single-threaded pytest; the Slurm leg mostly waits (on signals, holds, a lost
# node's timeout). The main suite prints as it goes; each leg's output goes to its own log, printed once all three
# have ended. The exit code is the first failing one's (main, oldest, Slurm). Run from the README's test command,
# with the venv's python first on PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=$(mktemp -d)
.ci/oldest.sh "$@" > "$logs/oldest.log" 2>&1 &
oldest=$!
.ci/slurm.sh "$@" > "$logs/slurm.log" 2>&1 &
slurm=$!
python -m pytest "$@"
main_status=$?
wait "$oldest"
oldest_status=$?
wait "$slurm"
slurm_status=$?
echo "=== .ci/oldest.sh (exit $oldest_status)"
cat "$logs/oldest.log"
echo "=== .ci/slurm.sh (exit $slurm_status)"
cat "$logs/slurm.log"
rm -rf "$logs"
for status in "$main_status" "$oldest_status" "$slurm_status"; do
    if [ "$status" -ne 0 ]; then
        exit "$status"
    fi
done
