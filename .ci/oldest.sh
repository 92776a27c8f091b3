#!/usr/bin/env bash
# The oldest supported combination (docs/versions.md; the lower bounds in pyproject.toml) in a second
# virtual environment: the tests marked `compat` (every unit test but the few marked `newest_only`, one 2-process
# ZeRO-3 save/reload, one resume against the uninterrupted run, and DeepSpeed 0.19.2's checkpointing fallback). Run
# from the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
# DeepSpeed compiles its CPU ops (shared-memory comm) on first use into torch's extension cache, one directory per op
# name for every DeepSpeed version: keep this venv's builds apart from the newest's.
export TORCH_EXTENSIONS_DIR="$PWD/.venv-oldest/torch_extensions"
# The embedded tiny models and data, built by this venv's versions: the files they write carry them (config.json's
# transformers_version, say), and in the cache the main suite shares, which session built a model first would decide
# what the other's saves are compared with
export TRL_EXT_CACHE="$PWD/.venv-oldest/trl_ext_cache"
.ci/uv_install.sh .venv-oldest torch==2.13.0 -e ".[test]" \
    "trl==1.14.2" "transformers==5.10.4" "accelerate==1.13.0" "peft==0.20.0" "deepspeed==0.19.2"
# Build DeepSpeed's CPU comm op once, while the unit tests run, rather than inside the first launch's time bound (its
# compile took 12 minutes beside the other legs, 2026-12-03)
.venv-oldest/bin/python -c "from deepspeed.accelerator import get_accelerator as a
a().create_op_builder('ShareMemCommBuilder').load()" &
build=$!
# One training run per launch: DeepSpeed 0.19.2 cannot run several engines one after another in one process.
# The unit tests first, the launches last, once the main suite beside this leg has ended (.ci/test.sh sets
# TRL_EXT_CI_MAIN_DONE; at most 45 minutes' wait): with every leg running (load 15-34 on 2 cores) a 2-process launch
# that takes 110 s alone did not start training within 300 s (2026-12-03, 3 of 3).
export TRL_EXT_TESTS_ONE_RUN_PER_LAUNCH=1
status=0
# On two workers, as the main suite: alone on one it was the run's longest path (its unit tests 35% done 40 minutes
# in, at load 15-27, 2026-12-03)
.venv-oldest/bin/python -m pytest -m compat --ignore tests/distributed -n 2 --dist loadscope "$@" || status=$?
wait "$build"
for _ in $(seq 540); do
    [ -z "${TRL_EXT_CI_MAIN_DONE:-}" ] || [ -e "$TRL_EXT_CI_MAIN_DONE" ] && break
    sleep 5
done
.venv-oldest/bin/python -m pytest -m compat tests/distributed "$@" || status=$?
exit "$status"
