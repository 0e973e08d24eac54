"""A decode step's GEMMs at a given row count, by library: how far the fp32 linear layers of SmolLM2-135M are from
the weight stream and from the FMA peak (docs/BENCHMARKS.md, "CPU linear layers").

    .venv/bin/python scripts/gemm_decode_rows.py [--rows 16] [--threads 1] [--dtype bfloat16] [--isa auto,avx2]

Every shape gets 30 distinct weight matrices (one per layer; the LM head one), so the weights stream from DRAM as
in a real step. Per shape and library: the median of 30 passes over the 30 layers, in ms, the libraries timed in
rotation (one pass of each per round). Libraries: oneDNN on
weights packed for 16 and for 64 rows (`odma/models/cpu_linear.py` packs for 64), MKL on weights packed for the
row count (`torch.ops.mkl._mkl_linear`), `F.linear` (MKL, packing the weight on every call), and odma's own kernel
(backends/cpu_linear.py, where it builds here), the engine's default where it builds, once per --isa (auto: this
CPU's best, avx2: the AVX2 + FMA build; as `odma_<path>`). With --dtype bfloat16: oneDNN and odma's kernel only
(MKL has no bf16 GEMM here). --skip-libraries: odma's kernel alone. --quant: odma's kernel on GGUF blocks too
(`odma_<path>_q`: the layers in Q4_1 and the LM head in Q8_0, as SmolLM2's file holds them; random blocks with
small scales), against fp32 x.
"""

from __future__ import annotations

import argparse
import json

import torch

from backends import cpu_linear, cpu_quant
from odma.bench.gemm_rows import SHAPES, interleaved_ms, random_blocks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--isa", default="auto", help="odma kernel builds to time, comma-separated: auto, avx2")
    p.add_argument("--skip-libraries", action="store_true", help="time odma's kernel only")
    p.add_argument("--quant", action="store_true", help="also time the kernel on Q4_1 / Q8_0 blocks")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    m = args.rows
    kernels = [k for k in (cpu_linear.load(isa.strip()) for isa in args.isa.split(",")) if k is not None]
    quants = [q for q in (cpu_quant.load(isa.strip()) for isa in args.isa.split(",")) if q is not None] if args.quant else []
    out, totals = {}, {}
    for name, (k, n) in SHAPES.items():
        weights = [torch.randn(n, k).to(dtype) for _ in range(1 if name == "lm_head" else 30)]
        x = torch.randn(m, k).to(dtype)
        row = {"gflop": round(2 * m * k * n * len(weights) / 1e9, 3),
               "weight_mb": round(x.element_size() * k * n * len(weights) / 1e6, 1)}
        fns = {}
        for hint in () if args.skip_libraries else (16, 64):
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, hint) for w in weights]
            fns[f"onednn_packed{hint}"] = lambda packed=packed: [
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in packed]
        if dtype == torch.float32 and not args.skip_libraries:
            mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in weights]
            fns["mkl_packed"] = lambda: [torch.ops.mkl._mkl_linear(x, pw, w, None, m) for pw, w in zip(mkl, weights)]
            fns["f_linear"] = lambda: [torch.nn.functional.linear(x, w) for w in weights]
        for kernel in kernels:
            if kernel.serves(weights[0]):
                ours = [kernel.pack(w) for w in weights]
                fns[f"odma_{kernel.isa}"] = lambda kernel=kernel, ours=ours: [kernel(x, p, None, n) for p in ours]
        for quant in quants if dtype == torch.float32 else ():
            kind = 8 if name == "lm_head" else 3  # Q8_0 head, Q4_1 layers
            ours = [quant.pack(kind, random_blocks(kind, n, k, seed), k) for seed in range(len(weights))]
            fns[f"odma_{quant.isa}_q"] = lambda quant=quant, ours=ours, kind=kind: [quant(x, p, kind, n) for p in ours]
            row["quant_mb"] = round(sum(p.numel() for p in ours) / 1e6, 1)
        row.update(interleaved_ms(fns))
        del fns
        out[name] = row
        for key, value in row.items():
            totals[key] = round(totals.get(key, 0.0) + value, 2)
    out["step"] = totals
    print(json.dumps({"rows": m, "threads": args.threads, "dtype": args.dtype, "shapes": out}, indent=1))


if __name__ == "__main__":
    main()
