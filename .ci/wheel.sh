#!/usr/bin/env bash
# The wheel works anywhere: built from this checkout (`pip wheel . --no-deps`), installed with torch 2.13.0 in a
# fresh venv outside the checkout, then `trl-ext dpo` on the embedded model and data (FSDP2, 2 processes, 2 steps)
# run as the README's users would, from an empty directory, and its save verified with `trl-ext verify`. Everything
# (the venv, the asset cache) lives in a temporary directory, removed at the end. Run from the
# README's test command, with the venv's python first on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m pip wheel . --no-deps --wheel-dir "$work/wheel" -q
.ci/uv_install.sh "$work/venv" torch==2.13.0 "$work"/wheel/trl_ext-*.whl
mkdir "$work/empty"
cd "$work/empty"
# FSDP2, TRL's config: sharded like ZeRO-3, without compiling DeepSpeed's CPU op for this venv (70 CPU-seconds; the
# other legs run ZeRO-3)
export TRL_EXT_CACHE="$work/cache"
"$work/venv/bin/trl-ext" dpo --model_name_or_path trl-ext/tiny-llama-arith --dataset_name trl-ext/arithmetic-preference \
    --accelerate_config fsdp2 --num_processes 2 --max_steps 2
"$work/venv/bin/trl-ext" verify trainer_output   # TRL's default output directory
echo "wheel: trained and verified from an empty directory"
