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
# Build DeepSpeed's CPU comm op now, once, rather than inside the first test's launch timeout
.venv-oldest/bin/python -c "from deepspeed.accelerator import get_accelerator as a
a().create_op_builder('ShareMemCommBuilder').load()"
# One training run per launch: DeepSpeed 0.19.2 cannot run several engines one after another in one process
TRL_EXT_TESTS_ONE_RUN_PER_LAUNCH=1 .venv-oldest/bin/python -m pytest -m compat "$@"
