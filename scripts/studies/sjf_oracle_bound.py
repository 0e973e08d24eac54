"""How much can any order of service cut mean latency? sjf with a perfect predictor (the realized length) against
fcfs, through the serving engine's own scheduler on the CPU profile of the served model (`cpu-smollm2`), at the
real engine's settings (at most 64 running, 2,048 prompt tokens per step, 512 output tokens at most).

    .venv/bin/python scripts/studies/sjf_oracle_bound.py [--traces "nq;smollm2-answers,alpaca"] [--bursts 144,300,600]
        [--loads 0.9,1.1,1.3] [--poisson-requests 600] [--json runs/sjf_bound.json]

For each trace: bursts of N requests at t = 0, and Poisson arrivals at a share of the offline capacity (requests/s
of fcfs on the largest burst). Policies: `odma` with the text predictor and `odma/predict=oracle`; orders: fcfs,
sjf with the engine's aging bound (`--aging-rounds`) and sjf without aging. Prints, per row, sjf ÷ fcfs for mean
latency, TTFT p50, latency p99 and throughput. The oracle's row bounds what any predictor can reach.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from odma.analyze.experiment import ExperimentSpec, run_experiment
from odma.analyze.replay import EngineSpec
from odma.analyze.workload import WorkloadSpec
from odma.traces import load_trace

POLICIES = ("odma", "odma/predict=oracle")
KEYS = ("throughput_tps", "ttft_p50_s", "latency_mean_s", "latency_p99_s", "completed", "makespan_s")
NO_AGING = 10**9


def replay(trace, args, workload: WorkloadSpec, order: str, aging: int) -> dict:
    spec = ExperimentSpec(trace=trace.name, policies=",".join(POLICIES), predictor=args.predictor,
                          profile=args.profile, workload=workload,
                          engine=EngineSpec(max_batch=args.max_batch, max_prefill_tokens=args.max_prefill_tokens,
                                            scheduler="engine", schedule=order, sjf_aging_rounds=aging))
    rows = run_experiment(spec, trace=trace)["policies"]
    return {n: {k: rows[n].get(k) for k in KEYS} for n in POLICIES}


def compare(trace, args, workload: WorkloadSpec) -> dict:
    return {"fcfs": replay(trace, args, workload, "fcfs", args.aging_rounds),
            "sjf": replay(trace, args, workload, "sjf", args.aging_rounds),
            "sjf-no-aging": replay(trace, args, workload, "sjf", NO_AGING)}


def ratio_rows(scenario: str, runs: dict) -> list[str]:
    lines = []
    for policy in POLICIES:
        f = runs["fcfs"][policy]
        for order in ("sjf", "sjf-no-aging"):
            s = runs[order][policy]
            ratios = [s[k] / f[k] for k in ("latency_mean_s", "ttft_p50_s", "latency_p99_s", "throughput_tps")]
            lines.append(f"| {scenario} | {policy} | {order} | {f['latency_mean_s']:.1f} | "
                         + " | ".join(f"{r:.2f}" for r in ratios) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", default="nq;smollm2-answers,alpaca", help="trace specs, separated by ';'")
    p.add_argument("--predictor", default="default")
    p.add_argument("--profile", default="cpu-smollm2")
    p.add_argument("--bursts", default="144,300,600")
    p.add_argument("--loads", default="0.9,1.1,1.3")
    p.add_argument("--poisson-requests", type=int, default=600)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-prefill-tokens", type=int, default=2048)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--aging-rounds", type=int, default=512)
    p.add_argument("--split", default="test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="runs/sjf_bound.json")
    args = p.parse_args()
    result = {"args": vars(args), "traces": {}}
    lines = ["| scenario | policy | order | fcfs mean latency s | mean latency sjf ÷ fcfs | TTFT p50 | p99 latency | "
             "tok/s |", "|---|---|---|---|---|---|---|---|"]
    for name in args.traces.split(";"):
        trace = load_trace(name)
        out = result["traces"][name] = {}
        bursts = [int(n) for n in args.bursts.split(",")]
        for n in bursts:
            workload = WorkloadSpec(requests=n, split=args.split, max_new_tokens=args.max_new_tokens, seed=args.seed)
            out[f"burst {n}"] = compare(trace, args, workload)
            lines += ratio_rows(f"{name}, {n} at once", out[f"burst {n}"])
            print("\n".join(lines[-4:]), flush=True)
        largest = out[f"burst {max(bursts)}"]["fcfs"]["odma"]
        capacity = largest["completed"] / largest["makespan_s"]
        out["capacity_rps"] = capacity
        for load in (float(x) for x in args.loads.split(",")):
            workload = WorkloadSpec(requests=args.poisson_requests, split=args.split, arrivals="poisson",
                                    rate=capacity * load, max_new_tokens=args.max_new_tokens, seed=args.seed)
            out[f"poisson {load}"] = compare(trace, args, workload)
            lines += ratio_rows(f"{name}, Poisson {load:.0%}", out[f"poisson {load}"])
            print("\n".join(lines[-4:]), flush=True)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
