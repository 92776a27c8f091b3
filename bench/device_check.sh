#!/usr/bin/env bash
# trl_ext's GPU check in one call (bench/device_check.py says what it checks): on a GPU machine with nothing to
# download, it installs the wheels carried in .whl/ (and .whl2/, if there is one; bench/device_wheels.sh makes them)
# into /tmp/site, puts them and this working tree on PYTHONPATH, shows the card, then runs every step, each with its
# own time limit, all within 9 minutes from the start of this script (the device machine's limit is 10 per
# command), and prints the table.
#
#   bench/device_check.sh OUTDIR                    # on the GPU machine: results.json, table.txt, log.txt, console.txt
#   bench/device_check.sh OUTDIR --only qlora       # some steps only (device_check.py's options pass through)
#   bench/device_check.sh OUTDIR --smoke            # the same code on the CPU, in the test environment (no wheels)
#
# PYTHON picks the interpreter (default python3: on the GPU image, the one that holds PyTorch). Exit code: 0 when every
# step passed, 1 when a check failed or a step did not run, 3 when the wheels could not be installed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench/device_check.sh OUTDIR [--smoke] [--only STEP ...]}
shift
mkdir -p "$out"
start=$(date +%s)
PY=${PYTHON:-python3}
smoke=0
for arg in "$@"; do
    if [ "$arg" = "--smoke" ]; then smoke=1; fi
done
{
    if [ "$smoke" = 0 ]; then
        if ! compgen -G ".whl/*.whl" > /dev/null; then
            echo "device_check: no wheels in .whl/ (bench/device_wheels.sh makes them; carry .whl): trl, datasets," \
                 "DeepSpeed and bitsandbytes must be installed already"
        fi
        for dir in .whl .whl2; do
            if compgen -G "$dir/*.whl" > /dev/null; then
                echo "+ installing $(ls "$dir"/*.whl | wc -l) wheels from $dir into /tmp/site"
                "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
                    "$dir"/*.whl || { echo "device_check: the wheels in $dir could not be installed"; exit 3; }
            fi
        done
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
        nvidia-smi || echo "device_check: nvidia-smi failed"
        budget=$((525 - $(date +%s) + start))  # 9 minutes in all, the end's table and cleanup included
        set -- --budget "$budget" "$@"
    fi
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # trl_ext from this working tree
    export PYTHONUNBUFFERED=1
    echo "+ $PY bench/device_check.py $out $*  ($(date -u +%FT%TZ); $(( $(date +%s) - start )) s after the start)"
    "$PY" bench/device_check.py "$out" "$@"
} 2>&1 | tee "$out/console.txt"
exit "${PIPESTATUS[0]}"
