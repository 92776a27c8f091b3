#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels bench/device_check.sh installs on a GPU machine that has no network: the
# packages trl_ext needs that its image lacks (trl, datasets and their missing needs; DeepSpeed; bitsandbytes; PEFT in
# the tested range), all for CPython 3.12 on x86-64 Linux.
#
#   . .venv/bin/activate && bench/device_wheels.sh     # about a minute; prints each wheel's size and the total
#
# The image (torch 2.11 + CUDA 13, transformers 5.17, accelerate 1.15, safetensors, tokenizers, huggingface_hub,
# pyarrow, pandas, fsspec, xxhash, psutil, ninja, einops, msgpack, py-cpuinfo, nvidia-ml-py, jinja2...) keeps its own.
# Versions are pinned inside pyproject.toml's ranges, the ones CI tests:
# - trl 1.16.0, datasets 5.2.0 (+ dill, multiprocess), peft 0.21.2;
# - DeepSpeed 0.19.8, built here as a wheel with no compiled ops (DS_BUILD_OPS=0: nothing it needs for ZeRO-3 with a
#   torch optimizer is compiled), + hjson, pydantic (+ its core, annotated-types, typing-inspection, typing-extensions);
# - bitsandbytes 0.50.2 with only its CPU and CUDA 13 libraries kept (43 MB -> a few MB; torch 2.11 there is built for
#   CUDA 13.0, and bitsandbytes loads the library named after torch's CUDA version).
# Needs the test environment's python (pip, and torch: DeepSpeed's setup imports it). Set PYTHON to use another.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=.whl
rm -rf "$OUT"
mkdir -p "$OUT"

platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d "$OUT" \
    trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 peft==0.21.2 \
    hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions==4.16.0 \
    bitsandbytes==0.50.2 2>&1 | grep -v "^WARNING: Location" || true

# DeepSpeed is published as a source distribution only: a pure-Python wheel, its ops left to compile on first use
# (none is used here).
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" deepspeed==0.19.8 2>&1 \
    | grep -v "^WARNING: Location" || true

"$PY" - "$OUT" <<'EOF'
"""Keep bitsandbytes' CPU and CUDA 13 libraries only (its RECORD rewritten to match), then check what was made."""
import glob
import os
import subprocess
import sys
import tempfile
import zipfile

out = sys.argv[1]
(bnb,) = glob.glob(os.path.join(out, "bitsandbytes-*.whl"))
keep = ("libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so", "libbitsandbytes_cuda132.so")
dropped = []
trimmed = bnb + ".tmp"
with zipfile.ZipFile(bnb) as src, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        base = os.path.basename(item.filename)
        if base.startswith("libbitsandbytes_") and base not in keep:
            dropped.append(item.filename)
            continue
        data = src.read(item.filename)
        if item.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(line for line in lines if line.split(",", 1)[0] not in dropped).encode()
        dst.writestr(item, data, compress_type=zipfile.ZIP_DEFLATED)
    assert all(any(i.filename.endswith(k) for i in src.infolist()) for k in keep[:2]), "bitsandbytes lacks CUDA 13"
os.replace(trimmed, bnb)
# RECORD is written after the libraries were dropped: check nothing it lists is missing
with zipfile.ZipFile(bnb) as z:
    names = set(z.namelist())
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    listed = {line.split(",", 1)[0] for line in z.read(record).decode().splitlines() if line}
    assert listed <= names, f"RECORD lists missing files: {sorted(listed - names)[:5]}"

# DeepSpeed's wheel: no compiled op inside, and it imports (with this environment's torch, on CPU) from the wheel
(ds,) = glob.glob(os.path.join(out, "deepspeed-*.whl"))
with zipfile.ZipFile(ds) as z:
    compiled = [n for n in z.namelist() if n.endswith(".so")]
    assert not compiled, f"DeepSpeed's wheel holds compiled ops: {compiled}"
with tempfile.TemporaryDirectory() as target:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", target, ds, bnb], check=True)
    check = ("import deepspeed, bitsandbytes; from deepspeed.git_version_info import installed_ops; "
             "assert not any(installed_ops.values()), installed_ops; "
             "print('deepspeed', deepspeed.__version__, 'imports; compiled ops:', sum(installed_ops.values()), "
             "'| bitsandbytes', bitsandbytes.__version__, 'imports')")
    subprocess.run([sys.executable, "-c", check], check=True, env={**os.environ, "PYTHONPATH": target})
EOF

total=0
for f in "$OUT"/*.whl; do
    size=$(stat -c %s "$f")
    total=$((total + size))
    printf '%8.2f MiB  %s\n' "$(echo "$size / 1048576" | bc -l)" "$(basename "$f")"
done
printf '%8.2f MiB  total in %s (a device call carries at most 64 MiB with the working tree)\n' \
    "$(echo "$total / 1048576" | bc -l)" "$OUT"
