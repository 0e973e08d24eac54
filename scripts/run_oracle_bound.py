"""The oracle's bound on a served burst's own lengths: how much could a perfect order have cut this run's mean
latency? A replay's bound comes from recorded answers; a served run samples its own, so its bound differs. This
takes the lengths the server really produced (`output_tokens` in an `odma-bench serve` or `odma-bench peer`
result: each request's id and realized length in the order sent), gives each prompt of the burst that length, and
replays the burst through the serving engine's scheduler on the served model's CPU profile, fcfs against sjf on the
exact lengths (and, with --predictor, sjf on that predictor), prefilling in chunks as both servers do by default. Bursts only: every request arrives at t = 0.

    .venv/bin/python scripts/run_oracle_bound.py RESULT.json --trace runs/alpaca_test_x5.jsonl
        [--stage burst --system vllm] [--predictor smollm2] [--max-batch 64] [--measured -0.19]

--measured: the change in mean latency the real sjf run reached against its fcfs run (−0.19 for −19 %): printed
as a share of this run's bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from odma.analyze.experiment import ExperimentSpec, run_experiment
from odma.analyze.replay import EngineSpec
from odma.analyze.workload import WorkloadSpec
from odma.trace_records import Trace
from odma.traces import load_trace

ORACLE = "odma/predict=oracle"


def stage_result(result: dict, stage: str | None, system: str | None) -> dict:
    """One run's result: an `odma-bench serve` result as it is, or a stage and system of an `odma-bench peer` one."""
    if "stages" not in result:
        return result
    stages = result["stages"]
    if stage not in stages:
        raise SystemExit(f"no stage {stage!r} in the result; it has {sorted(stages)}")
    if system not in stages[stage]:
        raise SystemExit(f"no system {system!r} in stage {stage!r}; it has {sorted(stages[stage])}")
    return stages[stage][system]


def realized_trace(run: dict, trace: Trace) -> Trace:
    """The burst as served: its requests in the order sent, each with the length the server produced."""
    sent = run.get("output_tokens")
    if not sent:
        raise SystemExit("the result has no per-request lengths (`output_tokens`): it was written before they were "
                         "recorded")
    if not math.isinf(float(run.get("rate", math.inf))):
        raise SystemExit(f"this run arrived at {run['rate']}/s: the bound here is for bursts (all at t = 0)")
    by_id = {r.request_id: r for r in trace.records}
    missing = [rid for rid, _ in sent if rid not in by_id]
    if missing:
        raise SystemExit(f"{len(missing)} requests of the result are not in the trace (first: {missing[0]!r}): pass "
                         "the trace the run was served from")
    records = [dataclasses.replace(by_id[rid], output_tokens=tokens, arrival_s=0.0)
               for rid, tokens in sent if tokens is not None]
    return Trace(f"{trace.name}/served", records, trace.tokenizer, dict(trace.meta))


def bound(trace: Trace, predictor: str | None, max_batch: int, max_new_tokens: int, profile: str,
          chunked: bool = True) -> dict:
    policies = [ORACLE] + (["odma"] if predictor else [])
    out: dict = {}
    for order in ("fcfs", "sjf"):
        spec = ExperimentSpec(trace=trace.name, policies=",".join(policies), predictor=predictor, profile=profile,
                              workload=WorkloadSpec(max_new_tokens=max_new_tokens),
                              engine=EngineSpec(max_batch=max_batch, max_prefill_tokens=2048, scheduler="engine",
                                                schedule=order, chunked_prefill=chunked))
        rows = run_experiment(spec, trace=trace)["policies"]
        out[order] = {p: rows[p]["latency_mean_s"] for p in policies}
    gains = {p: 1 - out["sjf"][p] / out["fcfs"][p] for p in policies}
    return {"mean_latency_s": out, "oracle_gain": gains[ORACLE],
            "predictor_gain": gains.get("odma"), "requests": len(trace.records)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", help="an odma-bench serve or peer result JSON")
    p.add_argument("--trace", required=True, help="the trace the burst was drawn from (--burst-trace / --trace)")
    p.add_argument("--stage", default="burst")
    p.add_argument("--system", default="vllm", help="which system's run of a peer result (its lengths)")
    p.add_argument("--predictor", default=None, help="also replay sjf on this predictor (its expected share)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--profile", default="cpu-smollm2")
    p.add_argument("--prefill", choices=("chunked", "whole"), default="chunked",
                   help="the replayed scheduler's prefill: chunked in 2,048-token steps beside the decodes (vLLM's and "
                        "odma-serve's default), or whole prompts")
    p.add_argument("--measured", type=float, default=None, help="the real sjf run's change in mean latency")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    result = json.loads(Path(args.result).read_text())
    run = stage_result(result, args.stage, args.system)
    max_new = (result.get("sampling") or {}).get("max_tokens") or result.get("max_tokens")
    if not max_new:
        raise SystemExit("the result names no max_tokens (`sampling.max_tokens` or `max_tokens`): the replay needs the "
                         "length cap the run was served with")
    served = realized_trace(run, load_trace(args.trace))
    out = bound(served, args.predictor, args.max_batch, int(max_new), args.profile, args.prefill == "chunked")
    out["measured"] = args.measured
    line = f"{out['requests']} requests as served: the oracle's sjf {-out['oracle_gain']:+.1%} mean latency"
    if out["predictor_gain"] is not None:
        line += (f", {args.predictor} {-out['predictor_gain']:+.1%} "
                 f"({out['predictor_gain'] / out['oracle_gain']:.0%} of the bound)")
    if args.measured is not None:
        out["measured_share"] = -args.measured / out["oracle_gain"]
        line += f"; measured {args.measured:+.1%} = {out['measured_share']:.0%} of this run's bound"
    print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
