#!/usr/bin/env bash
# CI's gate (or, with TRL_EXT_TESTS_GATE=0, every test), in eight sessions side by side: from the start, the main
# suite on two pytest-xdist workers (printed as it goes), the oldest-versions leg (.ci/oldest.sh), the
# newest-versions leg (.ci/newest.sh), the Slurm leg (.ci/slurm.sh), the Ray leg (.ci/ray.sh) and the real-vLLM leg
# (.ci/vllm.sh); once the main suite has ended, two light ones: the wheel, installed in a fresh venv and run from an
# empty directory (.ci/wheel.sh), and SkyPilot's parser on the examples (.ci/skypilot.sh). The oldest leg's launches
# also wait for the main suite's end (TRL_EXT_CI_MAIN_DONE): with everything side by side from the start, the load
# reached 15-34 on 2 cores, and that leg's three 2-process launches, 110 s each alone, missed their time bound
# (2026-12-03, 3 of 3). This script's arguments go to each session. The two
# recipes the newest leg runs (DPO as written under ZeRO-3 and under FSDP2) run there only: the main suite runs the
# same recipes' other trainers and configs.
# On 2 cores one session alone leaves the machine idle a quarter of the time (measured): while a launch starts its
# processes on one core, while a rank works alone (saving, checking), while a test waits on a server, a kill or a time
# bound, while the Slurm leg waits on signals, holds and a lost node's timeout. The workers take the main suite's
# modules costliest first, one at a time as each becomes free, so that they end together (tests/conftest.py says
# which modules go together). The legs' output is printed once all have ended, and each session's wall and CPU time.
# Last comes a summary, a line per session and every failed test under it: CI shows only the output's tail.
# The exit code is the first failing session's. Run from the README's test command, with the venv's python first on
# PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
# The legs make their venvs with uv (.ci/uv_install.sh): with pip, their installs ran beside the tests for the first 33
# minutes (2026-12-02). uv compiles no bytecode either: a module is compiled when first imported.
# CI's gate: every fast test and one proof of each capability (tests/conftest.py: EXTRA); TRL_EXT_TESTS_GATE=0 runs all
export TRL_EXT_TESTS_GATE="${TRL_EXT_TESTS_GATE:-1}"
logs=$(mktemp -d)
export TIMEFORMAT="session time: %0R s wall, %0U s user + %0S s system CPU"
names=(oldest newest slurm ray vllm wheel skypilot)
after_main=(wheel skypilot)
export TRL_EXT_CI_MAIN_DONE="$logs/main.done"
declare -A pids
start() {
    { time ".ci/$1.sh" "${@:2}"; } > "$logs/$1.log" 2>&1 &
    pids[$1]=$!
}
for name in "${names[@]}"; do
    [[ " ${after_main[*]} " == *" $name "* ]] || start "$name" "$@"
done
{ time python -m pytest -n 2 --dist loadscope --no-loadscope-reorder \
    --deselect "tests/test_recipes.py::test_recipe_as_written_under_zero3[dpo]" \
    --deselect tests/distributed/test_fsdp2.py::test_dpo_recipe_as_written_under_fsdp2 "$@"; } 2>&1 | tee "$logs/main.log"
statuses=("${PIPESTATUS[0]}")
touch "$TRL_EXT_CI_MAIN_DONE"
for name in "${after_main[@]}"; do
    start "$name" "$@"
done
for i in "${!names[@]}"; do
    wait "${pids[${names[$i]}]}"
    statuses+=($?)
    echo "=== ${names[$i]}: .ci/${names[$i]}.sh (exit ${statuses[-1]})"
    # less pip's warnings, a line per package, about the machine's own package indexes
    grep -v "^WARNING: Location 'file://" "$logs/${names[$i]}.log"
done
echo "=== summary"
for i in "${!statuses[@]}"; do
    name=$([ "$i" -eq 0 ] && echo "main suite" || echo "${names[$((i - 1))]}")
    log="$logs/$([ "$i" -eq 0 ] && echo main || echo "${names[$((i - 1))]}").log"
    echo "$name: exit ${statuses[$i]}, $(grep -o 'session time: .*' "$log" | tail -1)"
    if [ "${statuses[$i]}" -ne 0 ]; then
        # pytest's own summary lines; a leg that failed before its tests started shows its last lines instead
        grep -hE '^(FAILED|ERROR) |Timeout|^=+ .*(failed|error).* =+$' "$log" | cut -c1-300 || tail -n 15 "$log"
    fi
done
rm -rf "$logs"
for status in "${statuses[@]}"; do
    if [ "$status" -ne 0 ]; then
        exit "$status"
    fi
done
