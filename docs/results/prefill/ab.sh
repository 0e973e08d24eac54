#!/bin/bash
# Prefill of one prompt of N tokens, the Python layers' SDPA (ODMA_CPU_STEP=decode) against the native step's tiled
# attention (ODMA_CPU_STEP=native), alternating, one thread; s_pp_cpu is prefill tokens per second of CPU time.
set -u
OUT=${OUT:-$PWD/docs/results/prefill}
for n in 512 1024 2048; do
  for round in 1 2 3; do
    order="decode native"; [ $round = 2 ] && order="native decode"
    for mode in $order; do
      ODMA_CPU_STEP=$mode .venv/bin/python -m odma.bench.cli batched --shape $n/1 --batch 1 --repeats 1 --json \
        > $OUT/pp${n}_${mode}_$round.json 2> $OUT/pp${n}_${mode}_$round.err
    done
  done
done
