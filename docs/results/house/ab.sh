#!/bin/bash
# NQ-144 through odma-serve, before (0812791) and after the house changes (scheduler config, predictor protocol,
# the server's engine door, backends by capability, native long prefill), alternating; seeded per request.
# Worktrees: BASE at 0812791, AFTER at the commit measured. Run from the repository root.
set -u
BASE=${BASE:-/work/wt/base} AFTER=${AFTER:-/work/wt/after} OUT=${OUT:-$PWD/docs/results/house}
export ODMA_DATA_DIR=${ODMA_DATA_DIR:-/work/shared/datasets}
for round in 1 2; do
  order="base after"; [ $round = 2 ] && order="after base"
  for tree in $order; do
    d=$([ $tree = base ] && echo $BASE || echo $AFTER)
    (cd $d && PYTHONPATH=$d $d/.venv/bin/python -m odma.bench.cli serve --start-server --max-tokens 512 --threads 1 \
      --kv-budget 1GiB --json --trace nq --num 144 --rate inf > $OUT/nq_${tree}_$round.json 2> $OUT/nq_${tree}_$round.err)
  done
done
