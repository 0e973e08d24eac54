"""`odma-bench balloon`: a long-context workload with KV ↔ activation ballooning off and on, same memory.

Memory: a KV pool of `--kv-budget` plus the activation reserve an engine must keep for its largest prefill
step (`--max-prefill-tokens` × the measured activation bytes per token). Without ballooning the reserve
only ever holds activations; with it, idle reserve is lent to the KV pool in segments and taken back
(live blocks migrate out) before a prefill needs it. Both runs use the engine's own Scheduler, KVPool,
BalloonPool and ElasticKV; the model is replaced by a step-time model measured on this CPU:

    step = decode_ms(batch) + kv_ms_per_1k × (context tokens read by decoding requests) / 1000
           + Σ over prefills of q × (prefill_ms_per_token + prefill_ms_per_1k_context × (start + q) / 1000)

(the last term is attention over a long prompt; all four constants were measured on this CPU).

Workload: short chat requests from a trace (its prompt and realized lengths) mixed with long requests
whose prompts are uniform in [--long-min, --long-max] tokens; Poisson arrivals at `--rate` per second.
Every step checks lent bytes + the step's activation peak <= the reserve.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, replace
from types import SimpleNamespace

from odma.bench.scheduler_bench import DEFAULT_STEP_MS
from odma.config import PoolConfig
from odma.engine.config import EngineConfig

# SmolLM2-135M fp32 on this CPU, 1 thread, from `odma-bench balloon --calibrate` (docs/BENCHMARKS.md,
# "Ballooning"): activation peak per prefill token (flat from 512 to 8192 tokens); decode at context
# 512 / 4096 / 8192: 70 / 131 / 232 ms (21.1 ms per 1K context); prefill 3.52 / 4.89 / 6.95 ms per token
# at 512 / 4096 / 8192 tokens (3.29 ms + 0.448 ms per 1K of context).
ACTIVATION_BYTES_PER_TOKEN = 32000
KV_MS_PER_1K_CONTEXT = 21.1
PREFILL_MS_PER_TOKEN = 3.29
PREFILL_MS_PER_1K_CONTEXT = 0.448


def add_arguments(p: argparse.ArgumentParser) -> None:
    engine = EngineConfig()  # the server's defaults
    p.add_argument("--trace", default="nq", help="where the short requests come from")
    p.add_argument("--num-short", type=int, default=96)
    p.add_argument("--num-long", type=int, default=8)
    p.add_argument("--long-min", type=int, default=2048)
    p.add_argument("--long-max", type=int, default=8192)
    p.add_argument("--rate", type=float, default=4.0, help="arrivals per second (Poisson)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-budget", default="416MiB", help="the KV pool without ballooning (must hold the longest request)")
    p.add_argument("--bytes-per-token", type=int, default=46080, help="KV bytes per token (SmolLM2 fp32)")
    p.add_argument("--activation-bytes-per-token", type=int, default=ACTIVATION_BYTES_PER_TOKEN)
    p.add_argument("--max-prefill-tokens", type=int, default=8192, help="the largest prefill step (sizes the reserve)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--segment-tokens", type=int, default=512)
    p.add_argument("--keep-tokens", type=int, default=512)
    p.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=engine.balloon_chunked_prefill,
                   help="ballooning on: prefill a prompt whose activation room is lent in chunks of the free room")
    p.add_argument("--worst-case-prompt-share", type=float, default=engine.pool.worst_case_prompt_share,
                   help="both runs: a request whose prompt exceeds this share of the pool reserves its worst case up front")
    p.add_argument("--clear-window", action=argparse.BooleanOptionalAction, default=engine.clear_window,
                   help="both runs: relocate the blocks in the way of a request that holds the queue")
    p.add_argument("--predictor", default="default")
    p.add_argument("--preempt", default="wait", choices=["wait", "recompute", "swap"],
                   help="the engine's preemption mode in both runs (docs/BENCHMARKS.md used wait)")
    p.add_argument("--step-ms", default=DEFAULT_STEP_MS)
    p.add_argument("--kv-ms-per-1k", type=float, default=KV_MS_PER_1K_CONTEXT)
    p.add_argument("--engine", action="store_true",
                   help="run the real engine (SmolLM2 on this machine) instead of the step-time model; slow: scale "
                        "the workload down (e.g. --long-min 1024 --long-max 2048 --max-prefill-tokens 2048)")
    p.add_argument("--model", default="smollm2", help="--engine / --calibrate: the model")
    p.add_argument("--calibrate", action="store_true",
                   help="measure the step-time model's constants on this machine (the model at 512/4096/8192 tokens) and exit")
    p.add_argument("--prefill-ms-per-token", type=float, default=PREFILL_MS_PER_TOKEN)
    p.add_argument("--prefill-ms-per-1k-context", type=float, default=PREFILL_MS_PER_1K_CONTEXT)


@dataclass(frozen=True, slots=True)
class Job:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    long: bool
    prompt: str | None = None


def workload(args: argparse.Namespace) -> list[Job]:
    from odma.bench.serve_bench import _pick

    rng = random.Random(args.seed)
    short = _pick(args.trace, args.num_short, args.seed)
    jobs = [Job(0.0, r.prompt_tokens, max(1, min(args.max_tokens, r.output_tokens)), False, r.prompt) for r in short]
    outs = [j.output_tokens for j in jobs]
    jobs += [Job(0.0, rng.randint(args.long_min, args.long_max), rng.choice(outs), True) for _ in range(args.num_long)]
    rng.shuffle(jobs)
    t = 0.0
    timed = []
    for j in jobs:
        t += rng.expovariate(args.rate)
        timed.append(replace(j, arrival_s=t))
    return timed


def _percentile(xs: list[float], q: float) -> float:
    # the upper of two middles for a median (serve_bench's `_pct` takes the lower); the recorded results use this
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _result(balloon: bool, *, clock: float, useful: int, steps: int, peak: int, running_time: float,
            ttft: dict[bool, list[float]], counters, elastic, **extra) -> dict:
    """One run's summary; the same keys for the step-time model and the real engine."""
    c = counters
    out = {
        "balloon": balloon, "throughput_tps": useful / clock, "makespan_s": clock, "steps": steps,
        "peak_running": peak, "mean_running": running_time / clock,
        "ttft_short_p50_s": _percentile(ttft[False], 0.5), "ttft_short_p99_s": _percentile(ttft[False], 0.99),
        "ttft_long_p50_s": _percentile(ttft[True], 0.5), "ttft_long_max_s": max(ttft[True], default=float("nan")),
        "ttft_long_mean_s": sum(ttft[True]) / len(ttft[True]) if ttft[True] else float("nan"),
        "migrations": c.migrations, "preemptions": c.preemptions, "stalls": c.stalls,
        "admission_refusals": c.admission_refusals, "activation_refusals": c.activation_refusals,
        "prefill_chunks": c.prefill_chunks, "window_clears": c.window_clears, "window_moves": c.window_moves, **extra,
    }
    if elastic is not None:
        e = elastic.snapshot()
        out.update({k: e[k] for k in ("lends", "reclaims", "reclaim_failures", "peak_lent_bytes",
                                      "balloon_moved_blocks", "balloon_moved_bytes", "balloon_deflate_rollbacks")})
    return out


def simulate(jobs: list[Job], predictions, args: argparse.Namespace, *, balloon: bool) -> dict:
    from odma.analyze.simulate import SimJob, TableStepModel, parse_step_table, simulate as drive
    from odma.bench.scheduler_bench import CountingSwap, sim_pool
    from odma.engine.config import parse_kv_budget
    from odma.engine.prefill_cost import PLAIN_TOKENS
    from odma.engine.scheduler import Scheduler
    from odma.engine.scheduler_config import SchedulerConfig
    from odma.kv import ActivationProfile, BalloonPool, ContiguousKV, ElasticKV

    cap = args.max_tokens
    budget_tokens = parse_kv_budget(args.kv_budget, 1) // args.bytes_per_token
    policy, pool = sim_pool("odma", cap, budget_tokens, bytes_per_token=args.bytes_per_token,
                            worst_case_prompt_share=args.worst_case_prompt_share)
    act = args.activation_bytes_per_token
    profile = ActivationProfile({1: act, args.max_prefill_tokens: act * args.max_prefill_tokens})
    reserve = profile.peak_bytes(args.max_prefill_tokens)
    elastic = None
    if balloon:
        elastic = ElasticKV(BalloonPool(pool, args.segment_tokens), profile, reserve, keep_tokens=args.keep_tokens)
    swap = CountingSwap(args.bytes_per_token) if args.preempt == "swap" else None
    config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_prefill_tokens=args.max_prefill_tokens,
        # the step-time model prices a chunk's context itself (--prefill-ms-per-1k-context); the budget counts tokens
        prefill_cost=PLAIN_TOKENS,
        preempt=args.preempt,
        chunk_prefills=balloon and args.chunked_prefill,
        clear_window=args.clear_window,
    )
    scheduler = Scheduler(ContiguousKV(pool, elastic=elastic), config, swap)
    step_model = TableStepModel(parse_step_table(args.step_ms), args.prefill_ms_per_token, args.kv_ms_per_1k,
                                args.prefill_ms_per_1k_context)
    sim_jobs = [SimJob(f"r{n}", job.arrival_s, job.prompt_tokens, job.output_tokens, cap, pred)
                for n, (job, pred) in enumerate(zip(jobs, predictions))]
    check = None if elastic is None else (lambda work, step: elastic.check(step.prefill_tokens))
    sim = drive(sim_jobs, scheduler, step_model, buckets=policy.buckets, swap=swap, on_step=check)
    assert pool.stats().live_blocks == 0
    long_of = {f"r{n}": job.long for n, job in enumerate(jobs)}
    ttft: dict[bool, list[float]] = {False: [], True: []}
    for rec in sorted(sim.records.values(), key=lambda r: r.first_token_s):  # in the order they got a first token
        ttft[long_of[rec.job.request_id]].append(rec.ttft_s)
    return _result(balloon, clock=sim.clock, useful=sum(j.output_tokens for j in jobs), steps=sim.steps,
                   peak=sim.peak_running, running_time=sim.running_time, ttft=ttft, counters=scheduler.counters,
                   elastic=elastic, completed=sim.completed)


def run_engine(jobs: list[Job], args: argparse.Namespace, *, balloon: bool, long_ids: list[int]) -> dict:
    """The same workload through the real LLMEngine in wall-clock time (arrivals, TTFT and throughput are
    measured, not modelled). Each request generates exactly its realized length (ignore_eos)."""
    import time

    from odma.engine import LLMEngine, SamplingParams

    cfg = EngineConfig(model=args.model, kv_budget=args.kv_budget, balloon=balloon, max_prefill_tokens=args.max_prefill_tokens,
                       max_tokens_cap=args.max_tokens, default_max_tokens=args.max_tokens, max_num_seqs=args.max_num_seqs,
                       balloon_segment_tokens=args.segment_tokens, balloon_keep_tokens=args.keep_tokens,
                       length_log=None, predictor=args.predictor, preempt=args.preempt,
                       balloon_chunked_prefill=args.chunked_prefill, clear_window=args.clear_window,
                       pool=replace(PoolConfig(), worst_case_prompt_share=args.worst_case_prompt_share))
    engine = LLMEngine(cfg)
    tok = engine.tokenizer
    pending = sorted(jobs, key=lambda j: j.arrival_s)
    live: list[tuple[object, Job, float]] = []
    i = peak = 0
    running_time = 0.0
    t0 = time.monotonic()
    while i < len(pending) or engine.has_work():
        now = time.monotonic() - t0
        while i < len(pending) and pending[i].arrival_s <= now:
            job = pending[i]
            ids = long_ids[: job.prompt_tokens] if job.long else tok.encode(job.prompt, add_special_tokens=False)
            params = SamplingParams(max_tokens=job.output_tokens, temperature=0, ignore_eos=True)
            live.append((engine.add_request(ids, params), job, t0 + job.arrival_s))
            i += 1
        if not engine.has_work():
            time.sleep(min(0.05, max(0.0, pending[i].arrival_s - now)))
            continue
        started = time.monotonic()
        engine.step()
        running_time += engine.num_running * (time.monotonic() - started)
        peak = max(peak, engine.num_running)
    makespan = time.monotonic() - t0
    engine.pool.check_invariants()
    ttft = {False: [], True: []}
    for seq, job, arrival in live:
        ttft[job.long].append(seq.first_token_at - arrival)
    out = _result(balloon, clock=makespan, useful=sum(len(seq.output_ids) for seq, _, _ in live), steps=engine.steps,
                  peak=peak, running_time=running_time, ttft=ttft, counters=engine.scheduler.counters,
                  elastic=engine.elastic,
                  completed=sum(1 for seq, _, _ in live if seq.finish_reason == "length"), errors=engine.errors,
                  activation_reserve_bytes=engine.elastic.reserve_bytes if engine.elastic else None)
    engine.close()
    return out


def calibrate(args: argparse.Namespace) -> dict:
    """The constants of the step-time model, measured with the real model (one thread): activation peak per
    prefill token (Backend.activation_peak_bytes), prefill ms per token and decode ms at several contexts."""
    import time

    import torch

    from backends import get_backend
    from backends import Span
    from odma.engine.model_runner import ModelRunner
    from odma.models import load_model, resolve_model
    from odma.models.llama import SeqSlot

    torch.set_num_threads(1)
    model = load_model(resolve_model(args.model))
    sizes = (512, 4096, 8192)
    runner = ModelRunner(model, get_backend("cpu"), max(sizes) + 16)  # its arena holds the decode contexts
    peaks = runner.profile_activations(list(sizes))  # what the engine profiles at start-up
    kv = runner.arena.view(Span(0, max(sizes) + 16))
    out: dict = {"model": args.model, "kv_bytes_per_token": runner.bytes_per_token, "threads": 1}
    with torch.inference_mode():
        for n in sizes:
            ids, pos = torch.zeros(n, dtype=torch.long), torch.arange(n)
            t = time.perf_counter()
            model(ids, pos, [SeqSlot(kv, 0, n)])
            prefill = time.perf_counter() - t
            decode = []
            for _ in range(5):
                t = time.perf_counter()
                model(torch.tensor([5]), torch.tensor([n]), [SeqSlot(kv, n, 1)])
                decode.append(time.perf_counter() - t)
            out[f"activation_bytes_per_token_{n}"] = round(peaks[n] / n)
            out[f"prefill_ms_per_token_{n}"] = round(prefill / n * 1e3, 3)
            out[f"decode_ms_context_{n}"] = round(sorted(decode)[2] * 1e3, 1)
    lo, hi = sizes[0], sizes[-1]
    out["kv_ms_per_1k"] = round((out[f"decode_ms_context_{hi}"] - out[f"decode_ms_context_{lo}"]) / ((hi - lo) / 1e3), 2)
    slope = (out[f"prefill_ms_per_token_{hi}"] - out[f"prefill_ms_per_token_{lo}"]) / ((hi - lo) / 1e3)
    out["prefill_ms_per_1k_context"] = round(slope, 3)
    out["prefill_ms_per_token"] = round(out[f"prefill_ms_per_token_{lo}"] - slope * lo / 1e3, 3)
    return out


def _long_prompt_ids(jobs: list[Job], args: argparse.Namespace) -> list[int]:
    """Token ids of real text (the short prompts, repeated) long enough for the longest long prompt."""
    from transformers import AutoTokenizer

    from odma.models import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(args.model)))
    text = "\n\n".join(j.prompt for j in jobs if j.prompt)
    ids = tok.encode(text, add_special_tokens=False)
    need = max((j.prompt_tokens for j in jobs if j.long), default=0)
    return (ids * (need // max(1, len(ids)) + 1))[:need]


def run(args: argparse.Namespace) -> dict:
    from odma.engine.config import parse_kv_budget
    from predictor import load_predictor

    if args.calibrate:
        return calibrate(args)
    jobs = workload(args)
    records = [SimpleNamespace(prompt=j.prompt, prompt_tokens=j.prompt_tokens, output_tokens=j.output_tokens) for j in jobs]
    predictions = [(p.length, p.uncertainty) for p in load_predictor(args.predictor).predict(records)]
    kv = parse_kv_budget(args.kv_budget, 1)
    if args.engine:
        long_ids = _long_prompt_ids(jobs, args)
        runs = [run_engine(jobs, args, balloon=b, long_ids=long_ids) for b in (False, True)]
        reserve = runs[1]["activation_reserve_bytes"]  # profiled by the engine
    else:
        runs = [simulate(jobs, predictions, args, balloon=b) for b in (False, True)]
        reserve = args.activation_bytes_per_token * args.max_prefill_tokens
    off, on = runs
    return {
        "trace": args.trace, "num_short": args.num_short, "num_long": args.num_long,
        "long_prompt_tokens": [args.long_min, args.long_max], "rate": args.rate,
        "mode": "engine" if args.engine else "step-time model",
        "kv_budget_bytes": kv, "activation_reserve_bytes": reserve, "total_memory_bytes": kv + reserve,
        "max_prefill_tokens": args.max_prefill_tokens, "segment_tokens": args.segment_tokens,
        "chunked_prefill": args.chunked_prefill, "clear_window": args.clear_window,
        "worst_case_prompt_share": args.worst_case_prompt_share,
        "step_ms": args.step_ms, "kv_ms_per_1k": args.kv_ms_per_1k, "prefill_ms_per_token": args.prefill_ms_per_token,
        "prefill_ms_per_1k_context": args.prefill_ms_per_1k_context,
        "runs": runs,
        "peak_batch_ratio": on["peak_running"] / off["peak_running"],
        "mean_batch_ratio": on["mean_running"] / off["mean_running"],
        "throughput_ratio": on["throughput_tps"] / off["throughput_tps"],
        "ttft_short_p50_ratio": on["ttft_short_p50_s"] / off["ttft_short_p50_s"],
        "ttft_long_p50_ratio": on["ttft_long_p50_s"] / off["ttft_long_p50_s"],
    }
