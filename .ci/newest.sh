#!/usr/bin/env bash
# The newest releases users install, in a venv of its own: torch 2.15.0 (PyPI's build; the main suite pins 2.13.0, a
# CPU build), the newest transformers in range, and the same accelerate, peft, DeepSpeed and TRL as the main suite.
# Runs the fast tier, the DPO recipe as written under ZeRO-3 and under FSDP2 (the main suite leaves these two to this
# leg). Started by .ci/test.sh beside the others: alone on 2 cores it took 11.5 minutes, 11.2 CPU-minutes
# (2026-12-02).
set -euo pipefail
cd "$(dirname "$0")/.."
# Some machines' pip config caps torch below its newest release (a constraints file for the wheels on their disk):
# read no pip config here, so that PyPI's newest torch is the one installed.
export PIP_CONFIG_FILE=/dev/null
# The embedded models built by this venv's versions (config.json carries them), as .ci/oldest.sh does
export TRL_EXT_CACHE="$PWD/.venv-newest/trl_ext_cache"
.ci/uv_install.sh .venv-newest "torch==2.15.0" -e ".[test]"
.venv-newest/bin/python -c "import torch, transformers; print('newest: torch', torch.__version__, \
'transformers', transformers.__version__)"
# DeepSpeed's CPU comm op for this torch, built before the recipes' launches rather than under their timeout: while the
# fast tier runs (its compile took 5 minutes beside the other legs, 2026-12-02)
.venv-newest/bin/python -c "from tests import deepspeed_op; deepspeed_op.use_own_directory(); deepspeed_op.build()" &
build=$!
.venv-newest/bin/python -m pytest -m "not slow" "$@"
wait "$build"
.venv-newest/bin/python -m pytest "tests/test_recipes.py::test_recipe_as_written_under_zero3[dpo]" \
    tests/distributed/test_fsdp2.py::test_dpo_recipe_as_written_under_fsdp2 "$@"
