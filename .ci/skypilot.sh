#!/usr/bin/env bash
# SkyPilot's own parser (`sky.Task.from_yaml`, skypilot 0.14.1) on every task in examples/skypilot: the tests of
# tests/test_examples.py named skypilot, in a venv of their own (skypilot pins web-server packages, fastapi, starlette,
# click..., that the main test venv must not take), removed at the end. Run from the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.ci/uv_install.sh "$work/venv" skypilot==0.14.1 pytest pytest-timeout pyyaml
"$work/venv/bin/python" -c "import sky" # the parser is there: the tests must not skip
"$work/venv/bin/python" -m pytest -p no:cacheprovider --noconftest tests/test_examples.py -k skypilot "$@"
