"""Memory-aware routing vs power-of-two choices at N replicas, replayed (docs/ray.md).

`odma.bench.router_replay`: N engine schedulers, each with its own share of KV and the cost model's step times,
behind Ray Serve's default router (`pow2`) and odma's (`odma`), the same Poisson arrivals for both. The load is
given per replica (requests/s each), so every N sees the same pressure per replica.

    .venv/bin/python scripts/router_replay.py --trace sharegpt --replicas 2,4,8 --requests-per-replica 150 \
        --rate-per-replica 1.0 --budget-tokens 4000 --preempt recompute --seeds 0,1,2 --json runs/router_replay.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from odma.bench.router_replay import ROUTERS, replay_cluster
from odma.analyze.engine_replay import jobs_for
from odma.analyze.experiment import build_context, predictions_for
from odma.analyze.policies import build_manager, parse_policies
from odma.analyze.profiles import CostModel, load_profile
from odma.analyze.workload import WorkloadSpec, build_workload
from odma.engine.prefill_cost import PLAIN_TOKENS
from odma.engine.scheduler import Scheduler
from odma.engine.scheduler_config import SchedulerConfig
from odma.traces import load_trace

KEYS = ("throughput_tps", "ttft_p50_s", "ttft_p99_s", "latency_mean_s", "latency_p99_s", "preemptions")


def run_one(trace, args, n: int, seed: int) -> dict:
    workload = build_workload(trace, WorkloadSpec(requests=n * args.requests_per_replica, split=args.split,
                                                  arrivals="poisson", rate=n * args.rate_per_replica,
                                                  max_new_tokens=args.max_new_tokens,
                                                  max_model_len=args.max_model_len or args.budget_tokens // 2,
                                                  seed=seed))
    policy = parse_policies(args.policy)[0]
    predictions = predictions_for(workload, args.predictor, [policy])
    ctx = build_context(workload, predictions, args.budget_tokens)
    cost = CostModel(load_profile(args.profile))
    jobs = jobs_for(workload, policy, predictions)
    # whole prompts on the profile's cost model, which knows no model shape: the prefill budget counts tokens
    config = SchedulerConfig(max_num_seqs=args.max_batch, max_prefill_tokens=args.max_prefill_tokens,
                             prefill_cost=PLAIN_TOKENS, preempt=args.preempt)
    out = {}
    for router in args.routers.split(","):
        schedulers = [Scheduler(build_manager(policy, ctx), config) for _ in range(n)]
        out[router] = replay_cluster(jobs, schedulers, cost, router, max_num_seqs=args.max_batch, seed=seed)
        out[router]["refused"] = workload.refused
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="sharegpt")
    p.add_argument("--replicas", default="2,4,8")
    p.add_argument("--requests-per-replica", type=int, default=150)
    p.add_argument("--rate-per-replica", type=float, default=1.0, help="Poisson requests/s per replica")
    p.add_argument("--budget-tokens", type=int, default=4000, help="KV tokens per replica")
    p.add_argument("--policy", default="odma")
    p.add_argument("--predictor", default="default")
    p.add_argument("--profile", default="cpu-smollm2")
    p.add_argument("--max-batch", type=int, default=64, help="running requests per replica at most")
    p.add_argument("--max-prefill-tokens", type=int, default=2048)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + max_new_tokens above this is refused (default: half a replica's budget)")
    p.add_argument("--preempt", default="recompute", choices=["wait", "recompute"])
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--split", default="all")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--json", default="runs/router_replay.json")
    args = p.parse_args()
    trace = load_trace(args.trace)
    result = {"args": vars(args), "runs": {}}
    print("| replicas | seed | router | tok/s | TTFT p50 s | TTFT p99 s | mean latency s | p99 latency s | preemptions |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.replicas.split(",")):
        ratios: dict[str, dict[str, list[float]]] = {}
        for seed in (int(x) for x in args.seeds.split(",")):
            runs = result["runs"][f"{n}/{seed}"] = run_one(trace, args, n, seed)
            for router, r in runs.items():
                print(f"| {n} | {seed} | {router} | " + " | ".join(
                    f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in KEYS) + " |", flush=True)
            for a in (x for x in runs if x != "pow2" and "pow2" in runs):
                o, w = runs[a], runs["pow2"]
                entry = ratios.setdefault(a, {"throughput": [], "ttft_p99": [], "latency_p99": []})
                entry["throughput"].append(o["throughput_tps"] / w["throughput_tps"])
                entry["ttft_p99"].append(o["ttft_p99_s"] / w["ttft_p99_s"])
                entry["latency_p99"].append(o["latency_p99_s"] / w["latency_p99_s"])
        for a, entry in ratios.items():
            result.setdefault(f"{a}_over_pow2", {})[n] = {k: statistics.mean(v) for k, v in entry.items()}
            print(f"| {n} | mean | {a} ÷ pow2 | " + " | ".join(
                f"{k} {statistics.mean(v):.3f}" for k, v in entry.items()) + " | | | |", flush=True)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
