"""`odma-bench gpu`: the accelerator path measured in one run, one JSON out (scripts/gpu_check.sh runs it on a GPU).

- kernels: one layer's decode attention (K/V write, split-K attention, reduction) over contiguous blocks and over
  16-token pages scattered through the same arena: the same Triton code, reading in place or through a table. At
  each context × batch: microseconds, GB/s of K/V read against the device's measured copy bandwidth (bytes read +
  written by one large copy, STREAM's convention), and the old device path (torch SDPA once per request) where it
  is cheap enough to time. The shape is the paper model's attention (28 query heads, 4 KV heads, head_dim 128).
- vmm: growing a block by mapping physical granules behind its virtual range (CUDA's driver API) against copying a
  block of the same size, which is what growth costs without virtual memory.
- engine: odma's engine with random weights of the paper model's shape (DeepSeek-R1-Distill-Qwen-7B: 28 layers,
  28/4 heads, head_dim 128, bf16) on a natural-length trace, every policy on the same KV budget: all requests
  arrive at once with max_tokens = the cap (static reserves prompt + cap, as a worst-case server does) and each is
  ended at its trace length (tokens are forced: ignore_eos; random weights mean nothing).

`--tiny` shrinks every shape so the whole command runs on a CPU in Triton's interpreter (CI runs it so that it
cannot rot); its timings are the interpreter's and mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", help="cuda[:N] (cpu: only with --tiny, in Triton's interpreter)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: a dry run of every part (on CPU: interpreted)")
    p.add_argument("--parts", default="kernels,vmm,engine", help="which parts to run, comma-separated")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--contexts", default=None, help="decode contexts (default 1024,4096,16384; tiny: 64,256)")
    p.add_argument("--batches", default=None, help="decode batch sizes (default 1,16,64; tiny: 1,4)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per kernel variant (median reported)")
    p.add_argument("--trace", default="azure-conv", help="natural lengths for the engine part (odma.traces)")
    p.add_argument("--requests", type=int, default=None, help="requests in the engine burst (default 400; tiny: 12)")
    p.add_argument("--max-tokens", type=int, default=1024, help="every request's max_tokens (trace lengths are cut)")
    p.add_argument("--max-prompt", type=int, default=4096, help="longer prompts are cut to this")
    p.add_argument("--kv-budget", default=None, help="KV budget of every policy (default 4GiB; tiny: 64KiB)")
    p.add_argument("--policies", default="static,odma,paged,odma-map",
                   help="engine policies on the same KV budget; NAME-map: that policy growing by mapping "
                        "(--kv-growth map)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--out", default=None, help="also write the JSON here, rewritten after each part (a run cut short "
                                               "by a time limit keeps the parts it finished)")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device, rounds: int, iters: int) -> float:
    """Median over rounds of the mean time of `iters` calls (after one warm-up call)."""
    fn()
    _sync(device)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / iters * 1e3)
    return statistics.median(times)


def copy_bandwidth(device, nbytes: int, rounds: int) -> float:
    """GB/s of one large device copy, bytes read + written (STREAM's copy)."""
    import torch

    a = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    b = torch.empty_like(a)
    ms = _median_ms(lambda: b.copy_(a), device, rounds, 3)
    return 2 * nbytes / ms / 1e6


def _ints(spec: str | None, default: str) -> list[int]:
    return [int(x) for x in (spec or default).split(",") if x.strip()]


# -- kernels ----------------------------------------------------------------------------------------------------


def _kernel_case(device, dtype, ctx: int, batch: int, heads: int, kv_heads: int, dim: int, gen):
    """Contiguous blocks (with gaps) and the same K/V on scattered 16-token pages, two layers per token as in an
    engine arena (layer 1 is read)."""
    import torch
    from types import SimpleNamespace

    page, layers = 16, 2
    row = kv_heads * dim
    per_token = layers * 2 * row
    cap = -(-ctx // page) * page
    gap = page
    arena = torch.randn((batch * (cap + gap)) * per_token, generator=gen, device=device, dtype=dtype)
    blocks = [arena[i * (cap + gap) * per_token:(i * (cap + gap) + cap) * per_token].view(layers, 2, cap, kv_heads, dim)
              for i in range(batch)]
    pages_per = cap // page
    total_pages = batch * pages_per + 8
    order = list(range(total_pages))
    random.Random(0).shuffle(order)
    paged_arena = torch.zeros(total_pages * page * per_token, dtype=dtype, device=device)
    pview = paged_arena.view(total_pages, layers, 2, page, kv_heads, dim)
    tables = []
    for i, blk in enumerate(blocks):
        ids = order[i * pages_per:(i + 1) * pages_per]
        tables.append(ids)
        pview[ids] = blk.view(layers, 2, pages_per, page, kv_heads, dim).permute(2, 0, 1, 3, 4, 5)
    contiguous = [SimpleNamespace(kv=b, pages=None, start=ctx - 1, q_len=1) for b in blocks]
    paged = [SimpleNamespace(kv=pview, pages=t, start=ctx - 1, q_len=1) for t in tables]
    q = torch.randn(batch, heads, dim, generator=gen, device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads, dim, generator=gen, device=device, dtype=dtype)
    v = torch.randn(batch, kv_heads, dim, generator=gen, device=device, dtype=dtype)
    return contiguous, paged, q, k, v


def _sdpa_loop(slots, q, k, v, layer: int = 1):
    """The device path before the kernels: write and attend one request at a time."""
    import torch.nn.functional as F

    outs = []
    for i, s in enumerate(slots):
        cache = s.kv[layer]
        cache[0, s.start] = k[i]
        cache[1, s.start] = v[i]
        n = s.start + 1
        outs.append(F.scaled_dot_product_attention(q[i][None, :, None], cache[0, :n].transpose(0, 1)[None],
                                                   cache[1, :n].transpose(0, 1)[None], enable_gqa=True))
    return outs


def bench_kernels(args, device, dtype) -> dict:
    import torch

    from backends.triton_attention import TritonAttention

    heads, kv_heads, dim = (4, 2, 16) if args.tiny else (28, 4, 128)
    contexts = _ints(args.contexts, "64,256" if args.tiny else "1024,4096,16384")
    batches = _ints(args.batches, "1,4" if args.tiny else "1,16,64")
    gen = torch.Generator(device=device).manual_seed(0)
    att = TritonAttention(device)
    elem = torch.empty((), dtype=dtype).element_size()
    copy_gbps = copy_bandwidth(device, (8 << 20) if args.tiny else (2 << 30), args.rounds)
    rows = []
    iters = 1 if args.tiny else 20
    for ctx in contexts:
        for batch in batches:
            contiguous, paged, q, k, v = _kernel_case(device, dtype, ctx, batch, heads, kv_heads, dim, gen)
            steps = {"contiguous": att.plan_step(contiguous), "paged": att.plan_step(paged)}
            outs = {name: s.attend(1, q, k, v) for name, s in steps.items()}
            kv_bytes = batch * ctx * 2 * kv_heads * dim * elem
            row = {"context": ctx, "batch": batch, "kv_mib": round(kv_bytes / 2**20, 1),
                   "splits": steps["contiguous"].n_splits,
                   "max_abs_diff": (outs["contiguous"].float() - outs["paged"].float()).abs().max().item()}
            times = {}
            for name, step in steps.items():
                times[name] = _median_ms(lambda: step.attend(1, q, k, v), device, args.rounds, iters)
                row[f"{name}_us"] = round(times[name] * 1e3, 1)
                row[f"{name}_gbps"] = round(kv_bytes / times[name] / 1e6, 1)
                row[f"{name}_share_of_copy"] = round(kv_bytes / times[name] / 1e6 / copy_gbps, 3)
            row["plan_us"] = round(_median_ms(lambda: att.plan_step(contiguous), device, args.rounds, iters) * 1e3, 1)
            row["contiguous_vs_paged"] = round(times["paged"] / times["contiguous"], 3)
            if batch <= 16 or args.tiny:
                loop = _median_ms(lambda: _sdpa_loop(contiguous, q, k, v), device, args.rounds, max(1, iters // 4))
                row["sdpa_loop_us"] = round(loop * 1e3, 1)
                row["kernel_vs_sdpa_loop"] = round(loop / times["contiguous"], 2)
            rows.append(row)
            del contiguous, paged, steps, outs
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"shape": {"q_heads": heads, "kv_heads": kv_heads, "head_dim": dim, "dtype": str(dtype)},
            "copy_gbps": round(copy_gbps, 1), "rows": rows}


# -- virtual memory ---------------------------------------------------------------------------------------------


def bench_vmm(args, device) -> dict:
    """Map n granules behind a reserved range (granules made beforehand, as a pool keeps them) vs copy a block of
    the size growth would copy; also the first growth that has to make its granules."""
    import torch

    if device.type != "cuda":
        return {"skipped": "CUDA virtual memory needs a CUDA device"}
    from backends.cuda_vmm import CudaVMM

    vmm = CudaVMM(device.index or 0)
    g = vmm.granularity
    sizes = [g, 64 << 20, 1 << 30]
    out = {"granule_bytes": g, "rows": []}
    span = 2 * sizes[-1]
    ptr = vmm.reserve(span)
    try:
        for size in sizes:
            n = vmm.granules(size)
            handles = vmm.create(n)
            maps, unmaps = [], []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                vmm.map(ptr, handles)
                torch.cuda.synchronize(device)
                maps.append((time.perf_counter() - t0) * 1e3)
                if not maps[1:]:  # once: the mapped memory is usable
                    view = vmm.tensor(ptr, n * g, torch.float32)
                    view.fill_(3.0)
                    assert float(view[-1]) == 3.0 and float(view[0]) == 3.0
                    del view
                t0 = time.perf_counter()
                vmm.unmap(ptr, n)
                unmaps.append((time.perf_counter() - t0) * 1e3)
            vmm.release(handles)
            t0 = time.perf_counter()
            fresh = vmm.create(n)
            vmm.map(ptr, fresh)
            torch.cuda.synchronize(device)
            first = (time.perf_counter() - t0) * 1e3
            vmm.unmap(ptr, n)
            vmm.release(fresh)
            a = torch.empty(size, dtype=torch.uint8, device=device)
            b = torch.empty_like(a)
            copy = _median_ms(lambda: b.copy_(a), device, args.rounds, 3)
            del a, b
            out["rows"].append({"bytes": size, "map_ms": round(statistics.median(maps), 3),
                                "unmap_ms": round(statistics.median(unmaps), 3),
                                "create_and_map_ms": round(first, 3), "copy_ms": round(copy, 3),
                                "copy_vs_map": round(copy / statistics.median(maps), 2)})
    finally:
        vmm.free_range(ptr, span)
    return out


# -- engine -----------------------------------------------------------------------------------------------------


def _burst(engine, prompts, lengths, params) -> dict:
    """All requests at once; each is ended at its trace length. Returns what the burst did."""
    import torch

    before = _counts(engine)
    seqs = [engine.add_request(p, params) for p in prompts]
    target = {s.request_id: n for s, n in zip(seqs, lengths)}
    stopped: set[str] = set()
    running = []
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
        running.append(engine.num_running)
        for s in seqs:
            if s.request_id not in stopped and not s.finished and s.num_generated >= target[s.request_id]:
                engine.abort(s.request_id, "stop")
                stopped.add(s.request_id)
    if engine.backend.device.type == "cuda":
        torch.cuda.synchronize(engine.backend.device)
    seconds = time.perf_counter() - t0
    after = _counts(engine)
    generated = sum(min(s.num_generated, target[s.request_id]) for s in seqs)
    return {
        "seconds": round(seconds, 2), "output_tokens": generated, "tokens_per_s": round(generated / seconds, 1),
        "requests": len(seqs), "errors": sum(1 for s in seqs if s.finish_reason == "error"),
        "short": sum(1 for s in seqs if s.num_generated < target[s.request_id]),
        "peak_running": max(running), "mean_running": round(statistics.mean(running), 1), "steps": len(running),
        **{k: after[k] - before[k] for k in after},
    }


def _counts(engine) -> dict:
    c = engine.scheduler.counters
    stats = engine.pool.stats()
    return {"preemptions": c.preemptions, "migrations": stats.migrations, "migrated_tokens": stats.migrated_tokens,
            "grown_in_place": stats.grown_in_place, "swap_outs": c.swap_outs}


def bench_engine(args, device, dtype_name: str) -> dict:
    import torch

    from odma.config import PoolConfig
    from odma.engine import SamplingParams
    from odma.engine.config import EngineConfig
    from odma.engine.llm_engine import LLMEngine
    from odma.models import DTYPES
    from odma.models.tiny import PAPER_7B, TINY_QWEN2, random_model
    from odma.traces import load_trace

    shape = TINY_QWEN2 if args.tiny else PAPER_7B
    n = args.requests or (8 if args.tiny else 400)
    max_tokens = min(args.max_tokens, 16) if args.tiny else args.max_tokens
    max_prompt = min(args.max_prompt, 24) if args.tiny else args.max_prompt
    budget = args.kv_budget or ("48KiB" if args.tiny else "4GiB")
    records = load_trace(args.trace, limit=n).records[:n]
    rng = random.Random(0)
    prompts = [[rng.randrange(shape["vocab_size"]) for _ in range(max(1, min(r.prompt_tokens, max_prompt)))]
               for r in records]
    lengths = [max(1, min(r.output_tokens or 1, max_tokens)) for r in records]
    t0 = time.perf_counter()
    model = random_model(shape, DTYPES[dtype_name], str(device))
    made = time.perf_counter() - t0
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    out = {"model": "paper-7b" if not args.tiny else "tiny-qwen2", "dtype": dtype_name, "trace": args.trace,
           "requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "forced_output_tokens": sum(lengths),
           "max_tokens": max_tokens, "kv_budget": budget, "model_seconds": round(made, 1), "policies": {}}
    for name in [p.strip() for p in args.policies.split(",") if p.strip()]:
        policy, mapped = (name[:-4], True) if name.endswith("-map") else (name, False)
        config = EngineConfig(
            model=out["model"], device=str(device), dtype=dtype_name, kv_budget=budget, policy=policy,
            kv_growth="map" if mapped else "copy",
            attention="triton" if device.type == "cpu" else "auto", length_log=None, predictor="median",
            max_tokens_cap=max_tokens, default_max_tokens=max_tokens, max_num_seqs=args.max_num_seqs,
            max_prefill_tokens=max(8192, max_prompt), max_model_len=max_prompt + max_tokens,
            pool=PoolConfig(align=4 if args.tiny else 16), threads=1 if args.tiny else 4)
        engine = LLMEngine(config, model=model)
        # compile every kernel variant before the clock starts: short contexts (one split), longer ones (several)
        warm = [p[:8] for p in prompts[:4]] + [(p * 64)[: min(max_prompt, 512)] for p in prompts[:2]]
        engine.generate(warm, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        result = _burst(engine, prompts, lengths, params)
        result["kv_tokens"] = engine.pool.stats().total_tokens
        result["predictor"] = engine.predictor.name
        result["growth"] = "map" if type(engine.workers[0].kv).__name__ == "MappedKV" else "copy"
        out["policies"][name] = result
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    tps = {p: r["tokens_per_s"] for p, r in out["policies"].items()}
    if "odma" in tps and "static" in tps:
        out["odma_vs_static"] = round(tps["odma"] / tps["static"], 3)
    if "odma" in tps and "paged" in tps:
        out["odma_vs_paged"] = round(tps["odma"] / tps["paged"], 3)
    if "odma" in tps and "odma-map" in tps:
        out["map_vs_copy"] = round(tps["odma-map"] / tps["odma"], 3)
    return out


def run(args: argparse.Namespace) -> dict:
    import torch

    from backends import triton_attention
    from odma.errors import ConfigError
    from odma.models import DTYPES

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    if device.type == "cpu" and not args.tiny:
        raise ConfigError("odma-bench gpu on cpu runs only with --tiny (a dry run in Triton's interpreter)")
    why = triton_attention.available(device)
    if why is not None:
        raise ConfigError(f"odma-bench gpu: {why}")
    dtype_name = "float32" if device.type == "cpu" else args.dtype
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if parts - {"kernels", "vmm", "engine"}:
        raise ConfigError(f"--parts takes kernels, vmm and engine, got {args.parts!r}")
    result: dict = {"device": _device_name(device), "torch": torch.__version__, "tiny": args.tiny,
                    "interpreted": triton_attention.interpreting()}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    started = time.perf_counter()
    steps = (("kernels", lambda: bench_kernels(args, device, DTYPES[dtype_name])),
             ("vmm", lambda: bench_vmm(args, device)), ("engine", lambda: bench_engine(args, device, dtype_name)))
    for name, part in steps:
        if name not in parts:
            continue
        try:
            result[name] = part()
        except Exception as exc:  # noqa: BLE001 - one part failing must not lose the others' numbers
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.perf_counter() - started, 1)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return result


def _device_name(device) -> str:
    import torch

    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)"
    return f"cpu ({os.cpu_count()} logical CPUs)"


def main(argv: list[str] | None = None) -> int:
    """`python -m odma.bench.gpu_bench`: the same as `odma-bench gpu`, without importing the other benchmarks (a
    GPU machine may lack their dependencies)."""
    parser = argparse.ArgumentParser(prog="odma-bench gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    add_arguments(parser)
    args = parser.parse_args(argv)
    json.dump(run(args), sys.stdout, indent=None if args.json else 2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
