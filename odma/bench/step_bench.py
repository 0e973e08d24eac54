"""`odma-bench step`: one decode step of the served model at a given batch and context, per precision mix.

Every request's K/V sits in its own contiguous block (as in the engine) and the step is the engine's packed
forward. The mixes (weights dtype / KV dtype), each with torch's SDPA per request and with the CPU backend's
decode-attention kernel (fp32 caches only), are timed interleaved, round by round, so that a shared machine's
noise falls on all of them alike. This is what chose bf16 weights over an fp32 cache on CPU, and measures
what the kernel is worth. `--pieces N`: every request reads its first N rows from another block, as a prefix read in
place does (the kernel reads them in place; SDPA's path joins them first). `--linear native`: the model's GGUF blocks as the engine serves them (`--weights native`,
float32 mixes), once per --activations mode of the quantized kernel (ODMA_QUANT_ACTIVATIONS: f32, int8, auto).
"""

from __future__ import annotations

import argparse
import statistics
import time

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batch", type=int, default=32, help="decoding requests in the step")
    p.add_argument("--context", type=int, default=300, help="tokens already cached per request")
    p.add_argument("--mixes", default="float32/float32,bfloat16/float32,bfloat16/bfloat16",
                   help="weights/kv dtype pairs, comma-separated")
    p.add_argument("--attention", default="sdpa,kernel",
                   help="decode attention variants: sdpa (torch, per request), kernel (the CPU backend's, fp32 KV)")
    p.add_argument("--linear", default="torch",
                   help="linear-layer variants: torch (F.linear), onednn (weights packed once for oneDNN: fp32, and "
                        "bf16 where oneDNN has it), odma (the CPU backend's fp32 kernel, as the engine runs on CPU; "
                        "odma/models/cpu_linear.py), native (the GGUF's quantized blocks, float32 mixes); "
                        "'torch,onednn,odma' times three")
    p.add_argument("--activations", default="f32,int8",
                   help="with --linear native: the quantized kernel's activations to time (f32, int8, auto)")
    p.add_argument("--pieces", type=int, default=0,
                   help="every request reads its first PIECES cached rows from a block of its own (a prefix read in "
                        "place, a block continued elsewhere), the rest from its block (default 0: one block each)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=8, help="timed steps per mix (interleaved)")


def _parse_mixes(spec: str) -> list[tuple[str, str]]:
    from odma.errors import ConfigError

    mixes = []
    for item in spec.split(","):
        weights, _, kv = item.strip().partition("/")
        if weights not in DTYPE_NAMES or kv not in DTYPE_NAMES:
            raise ConfigError(f"bad mix {item!r}: expected WEIGHTS/KV with dtypes from {DTYPE_NAMES}")
        mixes.append((weights, kv))
    return mixes


def run(args: argparse.Namespace) -> dict:
    import torch

    from backends import get_backend
    from odma.models import DTYPES
    from odma.errors import ConfigError
    from odma.models import load_model, resolve_model
    from odma.models.llama import SeqSlot

    torch.set_num_threads(args.threads)
    mixes = _parse_mixes(args.mixes)
    if not 0 <= args.pieces <= args.context:
        raise ConfigError(f"--pieces must be between 0 and --context ({args.context}), got {args.pieces}")
    variants = [a.strip() for a in args.attention.split(",") if a.strip()]
    if not variants or set(variants) - {"sdpa", "kernel"}:
        raise ConfigError(f"--attention takes sdpa and/or kernel, got {args.attention!r}")
    kernel = get_backend("cpu").decode_attention() if "kernel" in variants else None
    if "kernel" in variants and kernel is None:
        raise ConfigError("the CPU decode-attention kernel could not be built here (see the log)")
    linears = [x.strip() for x in args.linear.split(",") if x.strip()]
    if not linears or set(linears) - {"torch", "onednn", "odma", "native"}:
        raise ConfigError(f"--linear takes torch, onednn, odma and/or native, got {args.linear!r}")
    modes = [a.strip() for a in args.activations.split(",") if a.strip()]
    quant, packed = None, {}
    if "native" in linears:
        from backends import cpu_quant
        from odma.models.weights import load_served_model

        quant = cpu_quant.load()
        before = quant.activations
        for mode in modes:
            quant.activations = mode  # checked here, before anything is timed
        packed["native", "float32"] = load_served_model(args.model, weights="native")[0]
    dense = set(linears) - {"native"}  # the variants that run the dense model
    folder = resolve_model(args.model) if dense else None
    models = {w: load_model(folder, dtype=DTYPES[w]) for w in {w for w, _ in mixes}} if dense else {}
    linear_kernel = get_backend("cpu").linear_kernel() if "odma" in linears else None
    if "odma" in linears and linear_kernel is None:
        raise ConfigError("the CPU linear kernel could not be built here (it needs AVX-512; see the log)")
    from odma.models.cpu_linear import pack_linears

    for linear in set(linears) - {"torch", "native"}:
        for w in models:
            m = load_model(folder, dtype=DTYPES[w])
            # fp32, bf16 where oneDNN has it; odma: the kernel for fp32, oneDNN for the rest
            if pack_linears(m, linear_kernel, mode=linear):
                packed[linear, w] = m
    c = (models.get(mixes[0][0]) or packed["native", "float32"]).config
    capacity = args.context + 16
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (args.batch,), generator=gen)
    positions = torch.full((args.batch,), args.context)
    steps = {}
    for weights, kv in mixes:
        # one arena for the batch, each request a contiguous block of it (filled with plausible values)
        arena = torch.randn(args.batch, c.num_layers, 2, capacity, c.num_kv_heads, c.head_dim, generator=gen).to(DTYPES[kv])
        seqs = [SeqSlot(arena[b], args.context, 1) for b in range(args.batch)]
        if args.pieces:  # the first rows in blocks of their own, the rest in the request's block
            first = arena[:, :, :, : args.pieces].clone()
            seqs = [SeqSlot(arena[b, :, :, args.pieces:], args.context, 1, pieces=[(first[b], 0, args.pieces)])
                    for b in range(args.batch)]
        for linear in linears:
            model = models.get(weights) if linear == "torch" else packed.get((linear, weights))
            if model is None:
                continue
            for attention in variants:
                if attention == "kernel" and kv != "float32":
                    continue  # the kernel reads fp32 caches only
                k = kernel if attention == "kernel" else None
                name = f"{weights}/{kv} {attention}" + ("" if linear == "torch" else f" {linear}")
                if linear != "native":
                    steps[name] = lambda model=model, seqs=seqs, k=k: model(ids, positions, seqs, k)
                    continue
                for mode in modes:

                    def step(model=model, seqs=seqs, k=k, mode=mode):
                        quant.activations = mode
                        return model(ids, positions, seqs, k)

                    steps[f"{name} {mode}"] = step
    times: dict[str, list[float]] = {k: [] for k in steps}
    for fn in steps.values():  # warm-up
        fn()
    for _ in range(args.rounds):
        for name, fn in steps.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    if quant is not None:
        quant.activations = before
    base = statistics.median(times[next(iter(times))])
    return {
        "model": args.model, "batch": args.batch, "context": args.context, "pieces": args.pieces, "threads": args.threads,
        "rounds": args.rounds,
        "mixes": {name: {"step_ms": round(statistics.median(ts) * 1e3, 2),
                         "tokens_per_s": round(args.batch / statistics.median(ts), 1),
                         "speedup_vs_first": round(base / statistics.median(ts), 3)} for name, ts in times.items()},
    }
