#!/usr/bin/env bash
# The accelerator path on one NVIDIA GPU in one command (about 9 minutes on an H100, caps included):
#   1. the GPU tests (CUDA conformance, Triton kernels, the engine through them, decode graphs, the driver's virtual
#      memory), at most TESTS_CAP seconds (150);
#   2. odma-bench gpu: contiguous vs paged decode kernels (context 1K/4K/16K x batch 1/16/64, GB/s against the
#      measured copy bandwidth, error against SDPA), the same for odma's vLLM backend (one-run vs scattered blocks in
#      vLLM's per-head planes, beside torch's SDPA over dense K/V), one growth step's mapping vs moving a 1/4 GiB block, a decode
#      step of the 7B shape at batch 16 as a CUDA graph and eagerly (host vs device time), and the engine with random
#      weights of the paper model's shape on a natural-length trace, odma vs static vs paged (vs odma growing by
#      mapping) on one KV budget, and odma-serve over HTTP against the engine alone on one burst (64 running). Each
#      part has a time cap (8.4 minutes in all); each measurement is tried on its own.
# Everything lands in OUT (default runs/gpu_check): env.txt, tests.log, gpu_check.json (rewritten after every
# measurement, so a run cut short keeps what it measured).
#
# Needs python3 with torch, triton and pytest (the GPU machines' image has them), the server's packages the image
# lacks as wheels in .whl/ (scripts/gpu_wheels.sh downloads them; installed into /tmp/site, no network) and the trace:
# the Azure conversation CSV under $ODMA_DATA_DIR/azure_llm_2023/ (default: ../shared/datasets, or .gpu/data when
# that exists, which is where a run that travels without ../shared carries it).
#   scripts/gpu_check.sh --stage        copy the trace into .gpu/data (git ignores it) so that it travels with the tree
#   scripts/gpu_check.sh [OUT]          on a GPU (docs/backends.md gives the command for a lent machine)
#   scripts/gpu_check.sh --cpu [OUT]    the CPU dry run (tiny shapes, Triton's interpreter, one test per file; CI
#                                       runs it)
# TESTS_CAP=S and GPU_BENCH_ARGS="--caps kernels=S,..." shorten a run to fit a lease.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--stage" ]; then
  src=${ODMA_DATA_DIR:-../shared/datasets}/azure_llm_2023/conv.csv
  mkdir -p .gpu/data/azure_llm_2023 && cp "$src" .gpu/data/azure_llm_2023/ && echo "staged $src in .gpu/data"
  exit $?
fi
CPU=0
if [ "${1:-}" = "--cpu" ]; then CPU=1; shift; fi
OUT=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && [ "$CPU" = 1 ] && PY=.venv/bin/python
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -z "${ODMA_DATA_DIR:-}" ] && [ -d .gpu/data ]; then export ODMA_DATA_DIR=$PWD/.gpu/data; fi
export PYTHONUNBUFFERED=1
status=0
if [ "$CPU" = 0 ] && compgen -G ".whl/*.whl" >/dev/null; then  # odma-serve's packages (the http part)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH || status=1
fi

"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/env.txt"
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError as e:
    print("triton missing:", e)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, p.multi_processor_count, "SMs", round(p.total_memory / 2**30), "GiB")
PYEOF

TESTS="tests/test_backends_conformance.py tests/test_triton_attention.py tests/test_engine_triton.py
       tests/test_decode_graphs.py tests/test_cuda_vmm.py tests/test_triton_runs.py"
if [ "$CPU" = 1 ]; then
  export TRITON_INTERPRET=1
  # the same stage, one quick test per file: the orchestration is what the dry run checks
  PICK=(-k "identity or single_token_block or paged_needs or buckets_cover or without_a_gpu or found_on_the_device")
  BENCH=(--device cpu --tiny --rounds 1 --caps kernels=120,runs=60,vmm=60,step=120,engine=300,http=240)
  TESTS_CAP=${TESTS_CAP:-300}
else
  PICK=()
  BENCH=()
  TESTS_CAP=${TESTS_CAP:-150}
fi
XDIST=""
[ "$CPU" = 0 ] && "$PY" -c "import xdist" 2>/dev/null && XDIST="-n 8"  # Triton compiles each variant once per process
# shellcheck disable=SC2086
timeout "$TESTS_CAP" "$PY" -m pytest -q $XDIST -p no:cacheprovider "${PICK[@]}" $TESTS 2>&1 | tee "$OUT/tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
# shellcheck disable=SC2086
"$PY" -m odma.bench.gpu_bench "${BENCH[@]}" ${GPU_BENCH_ARGS:-} --tests-log "$OUT/tests.log" --json --out "$OUT/gpu_check.json" \
  >/dev/null || status=1
"$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps(r, indent=1)[:8000])" "$OUT/gpu_check.json" \
  || status=1
exit $status
