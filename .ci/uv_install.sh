#!/usr/bin/env bash
# `.ci/uv_install.sh VENV ARGS...`: makes the venv VENV (if it is not there) and installs ARGS (as `pip install` takes
# them) into it with uv, reading this machine's pip settings (its indexes, wheel directories and constraints, from
# files or PIP_* variables, as pip would). The CI legs install this way; the README's own command uses pip.
# Why: on 2 cores the legs' six pip installs, each unpacking torch and its dependencies again, ran beside the tests
# for their first 33 minutes (2026-12-02). One such install took pip 109 CPU-seconds, uv 19.5 with its cache empty
# and 7.6 from its cache (torch 2.13.0 and `.[test]`, the same versions resolved; 2026-12-03).
set -euo pipefail
venv=$1
shift
[ -x "$venv/bin/python" ] || python3 -m venv --without-pip "$venv"
mapfile -t settings < <(python - <<'EOF'
import subprocess
import sys

listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True)
files, variables = {}, {}
for line in listed.stdout.splitlines():  # global.find-links='/opt/wheels' or :env:.find-links='/opt/wheels'
    key, _, value = line.partition("=")
    (variables if key.startswith(":env:") else files)[key.rsplit(".", 1)[-1]] = value.strip("'\"")
values = {**files, **variables}  # PIP_* variables win over files, as in pip
for key in ("index-url", "extra-index-url", "find-links", "constraint"):
    for value in values.get(key, "").split():
        print(f"--{key}")
        print(value)
EOF
)
# unsafe-best-match: the newest version on any index, as pip picks (uv's default stops at the first index that has it)
python -m uv pip install -q --python "$venv/bin/python" --index-strategy unsafe-best-match "${settings[@]}" "$@"
