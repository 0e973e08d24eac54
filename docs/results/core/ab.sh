#!/bin/bash
# NQ-144 through odma-serve, before (e8d00c0) and after the scheduling-core changes, alternating
export ODMA_DATA_DIR=/work/shared/datasets
for round in 1 2; do
  for tree in main base; do
    [ $round = 2 ] && tree=$([ $tree = main ] && echo base || echo main)
    d=$([ $tree = base ] && echo /tmp/base || echo /work/main)
    (cd $d && PYTHONPATH=$d /work/main/.venv/bin/python -m odma.bench.cli serve --start-server --max-tokens 512 --threads 1 --kv-budget 1GiB --json --trace nq --num 144 --rate inf > /work/main/runs/core/nq_${tree}_$round.json 2> /work/main/runs/core/nq_${tree}_$round.err)
  done
done
touch /work/main/runs/core/done
