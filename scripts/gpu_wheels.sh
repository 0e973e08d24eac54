#!/usr/bin/env bash
# The wheels odma-serve needs on the GPU machine, whose image lacks them (it has torch, triton, transformers,
# tokenizers, numpy, httpx, aiohttp, uvloop, h11, anyio, click, prometheus-client, typing-extensions): downloaded
# into .whl/ (git ignores it) at the versions this checkout's Python has, for CPython 3.12 on manylinux x86-64, each
# without its dependencies (the list below is all of them that the image lacks). scripts/gpu_check.sh installs
# them there with `pip install --no-index --no-deps --target /tmp/site .whl/*.whl` when .whl/ holds any.
#   scripts/gpu_wheels.sh            uses .venv/bin/python's versions (PYTHON=... another interpreter's)
# Needs network to PyPI (here, not on the GPU machine). A wheel of another version of the same package is removed
# first: two versions of one package stop the whole install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PACKAGES=(fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection annotated-doc
          opentelemetry-api typing-extensions anyio)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
           manylinux1_x86_64)
mkdir -p .whl
for name in "${PACKAGES[@]}"; do
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null) || {
    # a package only some versions of the others need (fastapi's annotated-doc): absent here, not needed
    echo "skip $name: not installed in $PY"; continue; }
  stem=$(echo "$name" | tr '[:upper:]-' '[:lower:]_')
  find .whl -maxdepth 1 -iname "${stem}-*.whl" ! -iname "${stem}-${version}-*.whl" -delete
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d .whl "$name==$version"
done
ls -l .whl
du -sh .whl
