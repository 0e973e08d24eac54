"""`odma-bench scheduler`: the serving engine's own Scheduler and KVPool driven without a model.

Each request of a trace is tagged by the predictor (L̂, u) and generates exactly its realized length; a step
costs a measured decode time for its batch size (interpolated) plus a per-token prefill time. This isolates
the scheduling and memory policy (wait vs recompute, odma vs s3 vs static) from the noise of a shared CPU:
the model's speed enters only through the step-time table, which `--step-ms` takes from a measurement
(the default was measured on this project's CPU for SmolLM2-135M fp32 with one thread).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

DEFAULT_STEP_MS = "1:62,6:103,16:148,32:243,64:592"  # decode batch size : ms per step (SmolLM2, 1 CPU thread)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default="nq")
    p.add_argument("--num", type=int, default=96, help="requests, all arriving at t=0 (saturation)")
    p.add_argument("--seed", type=int, default=0, help="selects the requests (same selection as odma-bench serve)")
    p.add_argument("--kv-budget", default="160MiB", help="KV budget in bytes (256MiB, 2GB, ...)")
    p.add_argument("--bytes-per-token", type=int, default=46080, help="KV bytes per token (SmolLM2 fp32: 46080)")
    p.add_argument("--max-tokens", type=int, default=512, help="max_tokens of every request; longer lengths are cut")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--predictor", default="default")
    p.add_argument("--policies", default="static,odma,s3")
    p.add_argument("--preempt", default="wait,recompute,swap", help="any of wait, recompute, swap")
    p.add_argument("--swap-gbps", type=float, default=10.0,
                   help="swap copy bandwidth, payload GB/s (memcpy measured 20.1 GB/s read + write)")
    p.add_argument("--admission-theta", default="1.0",
                   help="eLLM Algorithm 1 θ for odma/s3, comma-separated to compare (1.0: off)")
    p.add_argument("--reserve-scale", type=float, default=None, help="odma reserve_scale (default: the config's)")
    p.add_argument("--step-ms", default=DEFAULT_STEP_MS, help="decode batch:ms pairs, interpolated linearly")
    p.add_argument("--prefill-ms-per-token", type=float, default=3.5)


class CountingSwap:
    """A modelled host buffer for swap preemption: unlimited; its copies cost time at `gbps` (payload)."""

    def __init__(self, bytes_per_token: int, gbps: float = 10.0) -> None:
        self.bytes_per_token = bytes_per_token
        self.gbps = gbps
        self.copied_bytes = 0
        self.held: dict[str, int] = {}
        self.peak_held_bytes = 0
        self._charged = 0

    def swap_out(self, seq) -> bool:
        self.held[seq.request_id] = nbytes = seq.num_cached * self.bytes_per_token
        self.copied_bytes += nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, sum(self.held.values()))
        return True

    def swap_in(self, seq) -> None:
        self.copied_bytes += self.held.pop(seq.request_id)

    def drop(self, seq) -> None:
        self.held.pop(seq.request_id, None)

    def take_seconds(self) -> float:
        """Copy time of the bytes moved since the last call."""
        new, self._charged = self.copied_bytes - self._charged, self.copied_bytes
        return new / (self.gbps * 1e9)


def sim_pool(policy: str, max_tokens: int, budget_tokens: int, *, reserve_scale: float | None = None,
             bytes_per_token: int = 1, worst_case_prompt_share: float | None = None):
    """The engine's reservation policy for `policy` and a bookkeeping-only pool over `budget_tokens`."""
    from odma.kv import BucketConfig, KVPool, PoolConfig, build_policy

    pool_cfg = PoolConfig() if reserve_scale is None else replace(PoolConfig(), reserve_scale=reserve_scale)
    if worst_case_prompt_share is not None:
        pool_cfg = replace(pool_cfg, worst_case_prompt_share=worst_case_prompt_share)
    kv_policy = build_policy(policy, max_tokens=max_tokens, buckets=BucketConfig(), pool=pool_cfg)
    return kv_policy, KVPool(budget_tokens, kv_policy, large_share=0.0, align=pool_cfg.align,
                             bytes_per_token=bytes_per_token, worst_case_prompt_share=pool_cfg.worst_case_prompt_share)


def simulate(records, predictions, *, policy: str, preempt: str, budget_tokens: int, max_tokens: int,
             max_num_seqs: int, step_table, prefill_ms_per_token: float, reserve_scale: float | None = None,
             bytes_per_token: int = 46080, swap_gbps: float = 10.0, admission_theta: float = 1.0) -> dict:
    from odma.analyze.simulate import SimJob, TableStepModel, simulate as drive
    from odma.engine.config import EngineConfig
    from odma.engine.prefill_cost import PLAIN_TOKENS
    from odma.engine.scheduler import Scheduler
    from odma.engine.scheduler_config import SchedulerConfig
    from odma.kv import ContiguousKV

    kv_policy, pool = sim_pool(policy, max_tokens, budget_tokens, reserve_scale=reserve_scale)
    swap = CountingSwap(bytes_per_token, swap_gbps) if preempt == "swap" else None
    # whole prompts (no chunking), so the prefill cost is never read: the step table prices prefills per token
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_prefill_tokens=EngineConfig().max_prefill_tokens,
                             prefill_cost=PLAIN_TOKENS, preempt=preempt, admission_theta=admission_theta)
    scheduler = Scheduler(ContiguousKV(pool), config, swap)
    jobs = [SimJob(f"r{i}", 0.0, rec.prompt_tokens, max(1, min(max_tokens, rec.output_tokens)), max_tokens,
                   pred if policy != "static" else None) for i, (rec, pred) in enumerate(zip(records, predictions))]
    step_model = TableStepModel(step_table, prefill_ms_per_token=prefill_ms_per_token)
    sim = drive(jobs, scheduler, step_model, buckets=getattr(kv_policy, "buckets", None), swap=swap)
    c = scheduler.counters
    useful = sum(j.output_tokens for j in jobs)
    return {"policy": policy, "preempt": preempt, "admission_theta": admission_theta,
            "theta_refusals": c.theta_refusals, "throughput_tps": useful / sim.clock, "makespan_s": sim.clock,
            "steps": sim.steps, "peak_running": sim.peak_running, "migrations": c.migrations,
            "preemptions": c.preemptions, "stalls": c.stalls, "swap_outs": c.swap_outs,
            "swapped_bytes": swap.copied_bytes if swap else 0, "peak_host_bytes": swap.peak_held_bytes if swap else 0,
            "prefill_tokens": sim.prefill_tokens, "completion_tokens": useful}


def run(args: argparse.Namespace) -> dict:
    from odma.analyze.simulate import parse_step_table
    from odma.bench.serve_bench import _pick
    from odma.engine.config import parse_kv_budget
    from predictor import load_predictor

    records = _pick(args.trace, args.num, args.seed)
    predictions = [(p.length, p.uncertainty) for p in load_predictor(args.predictor).predict(records)]
    budget_tokens = parse_kv_budget(args.kv_budget, 1) // args.bytes_per_token
    runs = []
    for policy in args.policies.split(","):
        thetas = [float(t) for t in args.admission_theta.split(",")] if policy != "static" else [1.0]
        for preempt in args.preempt.split(",") if policy != "static" else ["wait"]:
            for theta in thetas:
                runs.append(simulate(records, predictions, policy=policy, preempt=preempt, budget_tokens=budget_tokens,
                                     max_tokens=args.max_tokens, max_num_seqs=args.max_num_seqs,
                                     step_table=parse_step_table(args.step_ms),
                                     prefill_ms_per_token=args.prefill_ms_per_token,
                                     reserve_scale=args.reserve_scale, bytes_per_token=args.bytes_per_token,
                                     swap_gbps=args.swap_gbps, admission_theta=theta))
    static = next((r["throughput_tps"] for r in runs if r["policy"] == "static"), None)
    for r in runs:
        r["x_static"] = r["throughput_tps"] / static if static else None
    return {"trace": args.trace, "num": args.num, "kv_budget": args.kv_budget, "budget_tokens": budget_tokens,
            "max_tokens": args.max_tokens, "predictor": args.predictor, "step_ms": args.step_ms,
            "prefill_ms_per_token": args.prefill_ms_per_token, "runs": runs}
