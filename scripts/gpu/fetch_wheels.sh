#!/usr/bin/env bash
# Download, on a machine with a package registry, the wheels the GPU machine lacks (its image has
# torch, triton, transformers, anyio, uvloop but no msgspec, pyzmq, starlette, uvicorn, llguidance), plus
# FlashInfer (the kernel peer) and what it needs, and py-spy (its binary lands in /tmp/site/bin).
# They go to .whl/ (git-ignored), which the GPU call carries and scripts/gpu/run.sh installs.
set -euo pipefail
cd "$(dirname "$0")/../.."
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$@"
}
download msgspec==0.23.0 pyzmq==27.3.0 starlette==1.10.0 uvicorn==0.54.0 setproctitle==1.3.7
download --platform manylinux_2_31_x86_64 llguidance==1.9.1  # constrained decoding (glibc >= 2.31)
download flashinfer-python==0.5.3 apache-tvm-ffi==0.1.15.post2 nvidia-cudnn-frontend==1.32.0
download --platform manylinux1_x86_64 py-spy==0.4.3  # spec_tuning.py's per-actor profiles
ls -la .whl
