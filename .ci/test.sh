#!/usr/bin/env bash
# Every test, in four sessions side by side from the start: the main suite in two halves (`python -m pytest
# tests/distributed`, printed as it goes, and `python -m pytest --ignore=tests/distributed`), the oldest-versions leg
# (.ci/oldest.sh) and the Slurm leg (.ci/slurm.sh); this script's arguments go to each. On 2 cores one session alone
# leaves the machine idle a quarter of the time (measured): while a launch starts its processes on one core, while a
# rank works alone (saving, checking), while a test waits on a server, a kill or a time bound, while the Slurm leg
# waits on signals, holds and a lost node's timeout. The others' output is printed once all have ended. The exit code is
# the first failing session's. Run from the README's test command, with the venv's python first on PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=$(mktemp -d)
names=(rest oldest slurm)
python -m pytest --ignore=tests/distributed "$@" > "$logs/rest.log" 2>&1 &
pids=($!)
.ci/oldest.sh "$@" > "$logs/oldest.log" 2>&1 &
pids+=($!)
.ci/slurm.sh "$@" > "$logs/slurm.log" 2>&1 &
pids+=($!)
python -m pytest tests/distributed "$@"
statuses=($?)
for i in "${!names[@]}"; do
    wait "${pids[$i]}"
    statuses+=($?)
    echo "=== ${names[$i]}: $([ "${names[$i]}" = rest ] && echo "python -m pytest --ignore=tests/distributed" || echo ".ci/${names[$i]}.sh") (exit ${statuses[-1]})"
    cat "$logs/${names[$i]}.log"
done
rm -rf "$logs"
for status in "${statuses[@]}"; do
    if [ "$status" -ne 0 ]; then
        exit "$status"
    fi
done
