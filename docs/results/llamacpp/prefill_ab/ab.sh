#!/bin/bash
# Prefill rows in the native step: odma-serve alone on the Q4_0 file, ODMA_CPU_STEP=decode (steps with prefill rows
# through the Python layers, the behaviour before) against native (the default now), alternating, two pairs.
cd "$(dirname "$0")/../../../.."
OUT=docs/results/llamacpp/prefill_ab
for round in 1 2; do
  for mode in decode native; do
    ODMA_CPU_STEP=$mode .venv/bin/odma-bench peer --peer-venv "$PWD/.peer-venv" --systems odma --odma-weights native \
      --llamacpp-model q4_0 --stages guidellm,nq --concurrency 1:8,16:64 --out runs/prefill_ab/$mode$round
    cp runs/prefill_ab/$mode$round/PEER.json $OUT/$mode$round.json
    cp runs/prefill_ab/$mode$round/PEER.txt $OUT/$mode$round.txt 2>/dev/null
  done
done
