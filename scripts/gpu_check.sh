#!/usr/bin/env bash
# The accelerator path on one NVIDIA GPU in one command of at most 8 minutes, caps included. The parts run in
# order (GPU_CHECK_PARTS picks them), each under its own time cap, each saving what it measured as it goes:
#   tests   the GPU tests that matter most (CUDA conformance, the engine through the Triton kernels, decode
#           graphs; GPU_TESTS names others), 8 processes, at most CAP_TESTS seconds (100; they took 76 on an H200)
#   bench   odma-bench gpu, parts kernels, engine, http and peer (BENCH_PARTS; runs, vmm and step were measured
#           before and stay available): first the decode kernels at 4K context, 16 and 64 requests (25 s): one
#           contiguous block, 16-token pages and a block read as two pieces (what --prefix-reads and
#           --continue-growth cost, which the replay charges as contiguous); then random weights of the paper
#           model's shape, every policy on one KV budget, on
#             ShareGPT's first turns (their text: SmolLM2's chat template; 200 requests) under odma with the
#               learned predictor, the running median and the oracle, paged and static, and odma reading shared
#               prefixes in place and continuing blocks that cannot grow in new ones (odma-pieces: --prefix-reads
#               --continue-growth);
#             Azure's conversation trace (lengths only; 400 requests) under odma, paged and odma continuing blocks
#               that cannot grow in new ones (odma-continue: --continue-growth);
#           then odma-serve over HTTP against the engine alone on one burst (64 running; its engine in a process of
#           its own, the default on a GPU), a second server with the engine in its process (--no-engine-process) on
#           the same burst (the CPU dry run, whose default is one process, runs --engine-process there), and
#           transformers' continuous
#           batching on ShareGPT's burst. At most CAP_BENCH seconds (445: 25 for the kernels, 225 for the engine's
#           bursts, shared in proportion to their tokens (seven of them took ~155), 120 for http, 75 for the peer).
# At most: env and wheels 15 s + tests 100 s + bench 445 s = 560 s; on an H200 it took 6 minutes (tests 70 s at
# the old cap, which cut their summary line; bench 282 s without the kernels).
# A new part: append `part_NAME` below and its name to PARTS.
# Everything lands in OUT (default runs/gpu_check): env.txt, tests.log, gpu_check.json (rewritten after every
# measurement, so a run cut short keeps what it measured), summary.txt (what it says, in a few lines:
# odma.bench.gpu_summary, printed too), parts.txt (seconds each part took).
#
# Needs python3 with torch, triton and pytest (the GPU machines' image has them). A machine without our data and
# model packages gets them from `.gpu/`, and odma-serve's packages as wheels from `.whl/` (scripts/gpu_wheels.sh;
# installed into /tmp/site, no network); both are git-ignored and travel with the tree (`carry`):
#   scripts/gpu_check.sh --stage [DIR]   stage into DIR (default .gpu) the Azure CSV, ShareGPT's records as JSONL
#                                        (first turns, and chat turns for a round of sharegpt-chat.jsonl),
#                                        SmolLM2's tokenizer (odma's cache) and the default learned predictor as a
#                                        self-contained folder, check that they load without those packages, print
#                                        the size
#   scripts/gpu_check.sh [OUT]           on a GPU (docs/backends.md gives the command for a lent machine)
#   scripts/gpu_check.sh --cpu [OUT]     the CPU dry run of the same plan (stages into OUT/stage; tiny shapes,
#                                        Triton's interpreter, one test per file; CI runs it)
# CAP_TESTS=S, CAP_BENCH=S, BENCH_PARTS=engine,step and GPU_BENCH_ARGS="--caps engine=S" reshape a run.
set -uo pipefail
cd "$(dirname "$0")/.."
SHAREGPT_REQUESTS=200
AZURE_REQUESTS=400
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY_LOCAL=.venv/bin/python || PY_LOCAL=$PY

stage() {  # stage DIR RECORDS: fill DIR, then load it back as a GPU machine would
  local dir=$1 records=$2
  # ShareGPT's first turns, and its chat turns (each sent with its conversation's earlier turns) for a later round
  "$PY_LOCAL" -m odma.bench.gpu_stage "$dir" --trace "sharegpt=$records" --trace "sharegpt-chat=$((2 * records))" \
    || return 1
  env -u ODMA_DATA_DIR -u ODMA_CACHE_DIR "$PY_LOCAL" -m odma.bench.gpu_stage --verify "$dir" || return 1
  echo "staged in $dir: $(du -sh "$dir" | cut -f1)"
}

if [ "${1:-}" = "--stage" ]; then
  stage "${2:-.gpu}" "$SHAREGPT_REQUESTS"
  exit $?
fi
CPU=0
if [ "${1:-}" = "--cpu" ]; then CPU=1; shift; fi
OUT=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$OUT"
[ "$CPU" = 1 ] && PY=$PY_LOCAL
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
status=0
if [ "$CPU" = 0 ] && compgen -G ".whl/*.whl" >/dev/null; then  # odma-serve's packages (the http part)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH || status=1
fi

if [ "$CPU" = 1 ]; then  # the dry run stages afresh and runs from the staged files, as a GPU machine must
  STAGED=$OUT/stage
  stage "$STAGED" 8 || exit 1
else
  STAGED=.gpu
fi
if [ -d "$STAGED/predictor/default" ]; then
  export ODMA_DATA_DIR=$PWD/$STAGED/data ODMA_CACHE_DIR=$PWD/$STAGED/cache
  [[ "$STAGED" = /* ]] && export ODMA_DATA_DIR=$STAGED/data ODMA_CACHE_DIR=$STAGED/cache
  LEARNED=$STAGED/predictor/default
  SHAREGPT=$STAGED/traces/sharegpt.jsonl
else  # a machine with our packages and ../shared
  LEARNED=default
  SHAREGPT=sharegpt
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

# what the engine part stands on: the CUDA backend, the engine through the Triton kernels, decode graphs (the
# kernels' own tests, test_triton_attention/_runs and test_cuda_vmm, ran before and stay for a longer lease)
TESTS=${GPU_TESTS:-tests/test_backends_conformance.py tests/test_engine_triton.py tests/test_decode_graphs.py}
ENGINE_RUNS=(--engine-run "$SHAREGPT:$SHAREGPT_REQUESTS=odma:$LEARNED,odma:median,odma:oracle,paged,static,odma-pieces:median"
             --engine-run "azure-conv:$AZURE_REQUESTS=odma,paged,odma-continue")
if [ "$CPU" = 1 ]; then
  export TRITON_INTERPRET=1
  # the same plan, one quick test per file: the orchestration is what the dry run checks
  PICK=(-k "identity or single_token_block or paged_needs or buckets_cover or without_a_gpu or found_on_the_device")
  # the caps only catch a hang here: the suite runs this at a low priority beside other tests (tests/early_jobs.py)
  BENCH=(--device cpu --tiny --rounds 1 --caps kernels=900,runs=900,vmm=900,step=900,engine=1200,http=900,peer=900
         "--http-also-flags=--engine-process")
  CAP_TESTS=${CAP_TESTS:-1200}
  CAP_BENCH=${CAP_BENCH:-3000}
else
  PICK=()
  BENCH=(--caps kernels=25,engine=225,http=120,peer=75,step=20 --contexts 4096 --batches 16,64
         "--http-also-flags=--no-engine-process")
  CAP_TESTS=${CAP_TESTS:-100}
  CAP_BENCH=${CAP_BENCH:-445}
fi

part_tests() {
  local xdist=""
  [ "$CPU" = 0 ] && "$PY" -c "import xdist" 2>/dev/null && xdist="-n 8"  # Triton compiles each variant per process
  # shellcheck disable=SC2086
  timeout "$CAP_TESTS" "$PY" -m pytest -q $xdist -p no:cacheprovider "${PICK[@]}" $TESTS 2>&1 | tee "$OUT/tests.log"
  [ "${PIPESTATUS[0]}" = 0 ]
}

part_bench() {
  local rc
  # shellcheck disable=SC2086
  timeout "$CAP_BENCH" "$PY" -m odma.bench.gpu_bench "${BENCH[@]}" --parts "${BENCH_PARTS:-kernels,engine,http,peer}" \
    "${ENGINE_RUNS[@]}" ${GPU_BENCH_ARGS:-} --tests-log "$OUT/tests.log" --json --out "$OUT/gpu_check.json" >/dev/null
  rc=$?
  # what the JSON says, in a few lines (also OUT/summary.txt)
  "$PY" -m odma.bench.gpu_summary "$OUT/gpu_check.json" | tee "$OUT/summary.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || return 1
  return $rc
}

PARTS=${GPU_CHECK_PARTS:-tests bench}
: >"$OUT/parts.txt"
for part in $PARTS; do
  started=$SECONDS
  if ! "part_$part"; then status=1; echo "part $part failed" >&2; fi
  echo "$part $((SECONDS - started)) s" | tee -a "$OUT/parts.txt"
done
exit $status
