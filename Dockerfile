# The image the Kubernetes examples name: this repository in /workspace, installed as the README installs it, with
# PyPI's torch (its Linux wheel is the CUDA build) in place of the README's CPU pin.
#
#   docker build -t ghcr.io/your-org/trl-ext:latest .                     # JobSet, LeaderWorkerSet, TrainJob
#   docker build --target ray -t ghcr.io/your-org/trl-ext-ray:latest .   # the RayJob: the ray extra too
#
# Never built where trl_ext is tested (no base image can be pulled there): hadolint checks it, and
# tests/test_image.py checks its install against the README's. The GPU driver comes from the node (NVIDIA's container
# toolkit). DeepSpeed compiles CUDA ops only for configs that ask for them (CPU offload, DeepSpeed's own optimizers);
# for those, start from an nvidia/cuda "devel" image with Python 3.11 instead.
FROM python:3.11-slim-bookworm AS base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1
WORKDIR /workspace
COPY . /workspace
RUN pip install --no-cache-dir torch==2.13.0 -e .

FROM base AS ray
RUN pip install --no-cache-dir -e ".[ray]"

FROM base AS trl-ext
