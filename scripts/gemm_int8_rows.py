"""The quantized GEMM with fp32 activations against int8 activations (integer dot products), per block type, layer
shape and row count: where `ODMA_QUANT_ACTIVATIONS=auto` should switch (backends/cpu_quant.py, INT8_ROWS).

    .venv/bin/python scripts/gemm_int8_rows.py [--rows 1,2,4,8,16] [--types Q4_0,Q4_1] [--threads 1] [--isa auto]

SmolLM2-135M's shapes (odma/bench/gemm_rows.py, as in scripts/gemm_decode_rows.py), 30 weight matrices each (the LM
head one), so the weights stream from DRAM as in a decode step; the K-quants (blocks of 256 depths) at K rounded up
to 768 where 576 is not a multiple. Per shape, type and row count: the median ms of --reps passes over the matrices,
the two paths timed in rotation, and f32 / int8 (above 1: int8 faster). The last lines: the summed step per type and
row count.
"""

from __future__ import annotations

import argparse
import json

import torch

from backends import cpu_quant
from odma.bench.gemm_rows import SHAPES, interleaved_ms, random_blocks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,3,4,6,8,12,16,32")
    p.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q6_K")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--isa", default="auto")
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernel = cpu_quant.load(args.isa)
    ids = {t.name: t.ggml_id for t in cpu_quant.BLOCK_TYPES.values()}
    rows = [int(r) for r in args.rows.split(",")]
    out, steps = [], {}
    for name in args.types.split(","):
        t = cpu_quant.BLOCK_TYPES[ids[name]]
        for shape in args.shapes.split(","):
            k, n = SHAPES[shape]
            k = -(-k // t.block) * t.block
            packed = [kernel.pack(t.ggml_id, random_blocks(t.ggml_id, n, k, seed), k)
                      for seed in range(1 if shape == "lm_head" else 30)]
            for m in rows:
                x = torch.randn(m, k)

                def run(mode: str, x=x, packed=packed, k=k, n=n) -> None:
                    kernel.activations = mode
                    for w in packed:
                        kernel(x, w, t.ggml_id, n)

                ms = interleaved_ms({"f32": lambda: run("f32"), "int8": lambda: run("int8")}, reps=args.reps)
                row = {"type": name, "shape": shape, "k": k, "n": n, "rows": m, **ms,
                       "f32/int8": round(ms["f32"] / ms["int8"], 2)}
                out.append(row)
                print(json.dumps(row), flush=True)
                step = steps.setdefault(f"{name} rows {m}", {"f32": 0.0, "int8": 0.0})
                step["f32"] += ms["f32"]
                step["int8"] += ms["int8"]
    for key, s in steps.items():
        print(json.dumps({"step": key, "f32": round(s["f32"], 2), "int8": round(s["int8"], 2),
                          "f32/int8": round(s["f32"] / s["int8"], 2)}))
    kernel.activations = cpu_quant.requested_activations()


if __name__ == "__main__":
    main()
