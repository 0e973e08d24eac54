"""`odma-bench profile`: where a prefill step and a decode step of odma's engine spend their time, and how far
each is from its roofline on this machine.

The engine runs in-process (the server's engine, its scheduler, pool, predictor and sampler) on real chat
prompts (NQ questions through the chat template, temperature 0.7, top_p 0.95, EOS ignored so the batch stays
full). Steps are timed plainly (median wall ms), then profiled with torch.profiler, every event's self time
assigned to one share:
- gemm: aten::mm / addmm / oneDNN's linear, and the CPU backend's own GEMM (a ctypes call, under a range named
  here): the linear layers and the LM head;
- attention: the CPU decode kernel (a ctypes call, under a range named here) and SDPA for prefill chunks;
- other ops: every other aten op inside the model (norms, rotary, SiLU, adds, copies, views, the embedding);
- model python: the model's Python between those ops (module calls, slicing, the per-request loop);
- native layers: a decode step's decoder layers in one call of the CPU backend's decode-step kernel (its GEMMs,
  attention, norms and the rest in C: the kernel's inside is not split);
- sampling: the sampler with its ops; scheduler: the scheduler's (pool) bookkeeping;
- engine: the rest of the step (runner glue, tagging with the predictor, outputs).
Profiling inflates small ops, so shares are of the profiled step and the plain wall time is reported apart.

Roofline: a step must at least stream the weights and the K/V it reads (bytes / measured read bandwidth of one
core) and do its FLOPs (2 per weight per token, 4·context·heads·head_dim per token per layer for attention)
at one core's measured GEMM peak; the bound is the larger of the two. The weight bytes are the linear layers' as
the engine holds them (--weights: fp32 or bf16 panels, or a GGUF's quantized blocks); dequantizing blocks is work
the FLOP count leaves out.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::_mkl_linear", "mkl::_mkl_linear", "mkldnn::_linear_pointwise"}
SDPA_PREFIX = ("aten::_scaled_dot_product", "aten::scaled_dot_product")
RANGES = ("odma.attention", "odma.linear", "odma.sampler", "odma.scheduler", "odma.model", "odma.layers")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--weights", default="f32", choices=("f32", "bf16", "native"),
                   help="the engine's weights (native: the GGUF's quantized blocks)")
    p.add_argument("--batch", default="16,64", help="decode batch sizes to profile")
    p.add_argument("--context", type=int, default=200, help="tokens cached per request when decode is profiled")
    p.add_argument("--steps", type=int, default=8, help="steps timed and profiled per point")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-budget", default="1GiB")
    p.add_argument("--max-num-seqs", type=int, default=None, help="engine cap (default: the largest --batch)")
    p.add_argument("--predictor", default="default")
    p.add_argument("--trace-out", default=None, help="write a chrome trace of the last profiled decode steps here")


def run(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    machine = measure_machine()
    out = {"threads": args.threads, "weights": args.weights, "machine": machine, "points": []}
    for batch in (int(b) for b in args.batch.split(",")):
        engine = _engine(args, batch)
        try:
            out["points"].append(_profile_point(engine, batch, args, machine))
        finally:
            engine.close()
    return out


def _engine(args, batch: int):
    from odma.engine.config import EngineConfig
    from odma.engine.llm_engine import LLMEngine

    from odma.models.weights import WEIGHT_DTYPES

    cfg = EngineConfig(model=args.model, threads=args.threads, kv_budget=args.kv_budget, length_log=None,
                       predictor=args.predictor, max_num_seqs=args.max_num_seqs or batch, max_tokens_cap=2048,
                       weights=args.weights, dtype=WEIGHT_DTYPES.get(args.weights, "float32"))
    return LLMEngine(cfg)


def _prompts(engine, n: int) -> list[str]:
    import random

    from odma.traces import load_trace

    recs = random.Random(0).sample([r for r in load_trace("nq").records if r.prompt], n)
    tok = engine.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": r.prompt}], add_generation_prompt=True, tokenize=False)
            for r in recs]


def _profile_point(engine, batch: int, args, machine: dict) -> dict:
    import torch

    from odma.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=2000, temperature=0.7, top_p=0.95, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in _prompts(engine, batch)]
    prompt_tokens = sum(s.prompt_tokens for s in seqs)
    with _ranges(engine):
        prefill = _measure(engine, lambda: any(s.num_cached < s.prompt_tokens for s in seqs), args, prefill=True)
        while min(s.num_tokens for s in seqs) < args.context:  # decode up to the context, untimed
            engine.step()
        decode = _measure(engine, lambda: True, args, prefill=False)
    from odma.models.cpu_linear import linear_weight_bytes

    ctx = statistics.fmean(s.num_tokens for s in seqs)
    cfg = engine.model.config
    weight_bytes = linear_weight_bytes(engine.model)
    point = {"batch": batch, "prompt_tokens": prompt_tokens, "decode_context_mean": round(ctx, 1),
             "prefill": prefill, "decode": decode}
    point["prefill"]["roofline"] = roofline(cfg, tokens=prompt_tokens, rows=batch, kv_read_tokens=0,
                                            attn_pairs=sum(s.prompt_tokens ** 2 / 2 for s in seqs),
                                            machine=machine, measured_ms=prefill["wall_ms_total"],
                                            weight_bytes=weight_bytes)
    point["decode"]["roofline"] = roofline(cfg, tokens=batch, rows=batch, kv_read_tokens=batch * ctx,
                                           attn_pairs=batch * ctx, machine=machine,
                                           measured_ms=decode["wall_ms_median"], weight_bytes=weight_bytes)
    for s in seqs:
        engine.abort(s.request_id)
    engine.step()
    if args.trace_out:
        point["trace"] = args.trace_out
    return point


def _measure(engine, more, args, prefill: bool) -> dict:
    """Plain wall times of steps (prefill: until every prompt is in; decode: --steps), then the same number of
    steps profiled (decode only: prefill cannot be repeated on the same requests, so its profile is the plain
    run's own, taken with the profiler on from the start)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if prefill:  # one pass, profiled; wall time is that pass's (the profiler's share is small next to big GEMMs)
        walls, t0 = [], time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            while more():
                t = time.perf_counter()
                engine.step()
                walls.append((time.perf_counter() - t) * 1e3)
        return {"steps": len(walls), "wall_ms": [round(w, 1) for w in walls], "wall_ms_total": round(sum(walls), 1),
                "shares": _shares(prof, sum(walls)), "top_ops": _top_ops(prof, 1), "profiled": True}
    walls = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - t) * 1e3)
    t_prof = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    prof_ms = (time.perf_counter() - t_prof) * 1e3 / args.steps
    if args.trace_out:
        prof.export_chrome_trace(args.trace_out)
    n_layers = engine.model.config.num_layers
    shares = _shares(prof, prof_ms * args.steps, per=args.steps)
    return {"steps": args.steps, "wall_ms_median": round(statistics.median(walls), 2),
            "wall_ms": [round(w, 1) for w in walls], "profiled_ms_per_step": round(prof_ms, 2),
            "shares": shares, "top_ops": _top_ops(prof, args.steps), "per_layer_us": {k: round(v["ms"] * 1e3 / n_layers, 1) for k, v in shares.items()
                                               if k in ("gemm", "attention", "other ops", "model python", "native layers")}}


def _shares(prof, total_ms: float, per: int = 1) -> dict:
    """Self time of every event, by share (see the module docstring); ms per step and % of the profiled time."""
    acc: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type.name != "CPU":
            continue
        acc[_category(e)] += e.self_cpu_time_total / 1e3
    accounted = sum(acc.values())
    acc["engine python"] = max(0.0, total_ms - accounted)  # outside every profiled event: the step's glue, the profiler
    return {k: {"ms": round(v / per, 2), "pct": round(100 * v / total_ms, 1)} for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}


def _top_ops(prof, per: int, n: int = 15) -> list[dict]:
    """The ops (and named ranges) with the most self time per step, with their call counts per step."""
    rows = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:n]
    return [{"op": a.key, "ms": round(a.self_cpu_time_total / 1e3 / per, 2), "calls": a.count // per} for a in rows]


def _category(e) -> str:
    name = e.name
    if name in GEMM_OPS:
        return "gemm"
    if name.startswith(SDPA_PREFIX):
        return "attention"
    scope = _enclosing(e)
    if name in RANGES:  # a range's self time is the Python inside it between profiled ops
        return {"odma.attention": "attention", "odma.linear": "gemm", "odma.sampler": "sampling",
                "odma.scheduler": "scheduler", "odma.model": "model python",
                "odma.layers": "native layers"}[name]  # the decode-step kernel: GEMMs, attention and the rest in C
    if scope == "odma.attention":
        return "attention"
    if scope == "odma.sampler":
        return "sampling"
    if scope == "odma.scheduler":
        return "scheduler"
    if scope == "odma.model":
        return "other ops"
    return "engine"


def _enclosing(e) -> str | None:
    p = e.cpu_parent
    while p is not None:
        if p.name in RANGES:
            return p.name
        p = p.cpu_parent
    return None


@contextmanager
def _ranges(engine):
    """Name the parts of a step for the profiler by wrapping them (undone afterwards; nothing changes when no
    profiler runs: record_function is a no-op then)."""
    from torch.profiler import record_function

    from odma.models.cpu_linear import KernelLinear
    from odma.models.quantized import QuantLinear

    worker = engine.workers[0]
    runner, sched = worker.runner, worker.scheduler
    saved = (runner.model.forward, runner.sampler, runner.attention, sched.schedule)
    native = runner.model.native_layers

    def wrap(fn, name):
        def inner(*a, **k):
            with record_function(name):
                return fn(*a, **k)
        inner.__wrapped__ = fn
        return inner

    class Kernel:  # the model calls kernel.plan_step(...) once a step and batch.attend → kernel(...) per layer
        def __init__(self, k):
            self.k = k

        def plan_step(self, *a, **kw):
            batch = self.k.plan_step(*a, **kw)
            if batch is not None:
                batch.kernel = self
            return batch

        def __call__(self, *a, **kw):
            with record_function("odma.attention"):
                return self.k(*a, **kw)

    linears = [m for m in runner.model.modules() if isinstance(m, (KernelLinear, QuantLinear))]  # the GEMM kernels
    runner.model.forward = wrap(runner.model.forward, "odma.model")
    runner.sampler = wrap(runner.sampler, "odma.sampler")
    if runner.attention is not None:
        runner.attention = Kernel(runner.attention)
    sched.schedule = wrap(sched.schedule, "odma.scheduler")
    for m in linears:
        m.kernel = wrap(m.kernel, "odma.linear")
    if native is not None:
        native.run = wrap(native.run, "odma.layers")
    try:
        yield
    finally:
        runner.model.forward, runner.sampler, runner.attention, sched.schedule = saved
        if native is not None:
            del native.run  # the instance attribute set above: the class's method again
        for m in linears:
            m.kernel = m.kernel.__wrapped__


def measure_machine(mib: int = 512) -> dict:
    """One core's read bandwidth (sum over a buffer larger than the caches) and GEMM peak: the fastest of torch's
    sgemm (MKL; on AMD CPUs it may not use AVX-512), oneDNN on a packed weight and the CPU backend's own GEMM
    (what the engine's linear layers call where they are available), fp32, 2048³."""
    import torch

    from backends import get_backend
    from odma.models.cpu_linear import KernelLinear, PackedLinear, onednn_linear_available

    x = torch.ones(mib << 18)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    gemms = {"mkl": lambda: a @ b}
    if onednn_linear_available():
        packed = PackedLinear(torch.nn.Linear(2048, 2048, bias=False))
        gemms["onednn"] = lambda: packed(a)
    kernel = get_backend("cpu").linear_kernel()
    if kernel is not None:
        ours = KernelLinear(torch.nn.Linear(2048, 2048, bias=False), kernel)
        gemms["odma"] = lambda: ours(a)
    best_read = float("inf")
    best_gemm = dict.fromkeys(gemms, float("inf"))
    x.sum()
    for gemm in gemms.values():
        gemm()
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best_read = min(best_read, time.perf_counter() - t)
        for name, gemm in gemms.items():
            t = time.perf_counter()
            gemm()
            best_gemm[name] = min(best_gemm[name], time.perf_counter() - t)
    gflops = {name: round(2 * 2048 ** 3 / sec / 1e9, 1) for name, sec in best_gemm.items()}
    return {"read_gbps": round(x.numel() * 4 / best_read / 1e9, 2), "gemm_gflops": max(gflops.values()),
            "gemm_gflops_by_library": gflops, "threads": torch.get_num_threads()}


def roofline(cfg, *, tokens: int, rows: int, kv_read_tokens: float, attn_pairs: float, machine: dict,
             measured_ms: float, weight_bytes: int | None = None) -> dict:
    """Lower bound of a step: max(bytes / bandwidth, FLOPs / GEMM peak). tokens: fed this step; rows: logits
    computed (one per request); kv_read_tokens: cached K/V rows read; attn_pairs: (query, key) pairs attended;
    weight_bytes: what the layers stream (default: every weight in fp32)."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer_params = h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h
    head_params = cfg.vocab_size * h
    weight_bytes = weight_bytes or (layers * layer_params + head_params) * 4
    kv_bytes = kv_read_tokens * layers * 2 * kv * 4
    flops = 2 * layers * layer_params * tokens + 2 * head_params * rows + 4 * attn_pairs * layers * q
    mem_ms = (weight_bytes + kv_bytes) / (machine["read_gbps"] * 1e9) * 1e3
    compute_ms = flops / (machine["gemm_gflops"] * 1e9) * 1e3
    bound = max(mem_ms, compute_ms)
    return {"weight_mb": round(weight_bytes / 1e6, 1), "kv_mb": round(kv_bytes / 1e6, 1), "gflop": round(flops / 1e9, 2),
            "memory_ms": round(mem_ms, 1), "compute_ms": round(compute_ms, 1),
            "bound": "compute" if compute_ms > mem_ms else "memory", "roofline_ms": round(bound, 1),
            "measured_ms": round(measured_ms, 1), "measured_over_roofline": round(measured_ms / bound, 2)}
