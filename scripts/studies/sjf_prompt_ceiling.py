"""How much of the oracle's sjf gain can ANY prompt-time predictor reach? The oracle orders by each request's own
realized length, sampling noise included; a predictor that reads the prompt can at best know the prompt's length
distribution. SmolLM2's multi-sample answers (datasets/smollm2_answers: 75 prompts per source answered 5 times)
give that distribution: `prompt-oracle` predicts each answer by the mean length of the other answers to its prompt
(a slight underestimate of the ceiling), `prompt-oracle:with-own` by the mean of all of them, this one included (a
slight overestimate).

For each prompt family, a burst of N answers at once (tiled from the family's multi-sample answers) goes through
the serving engine's scheduler on the served model's CPU profile, fcfs and sjf with aging, for each predictor (its
reservations in both, so only the order differs); the table gives sjf ÷ fcfs and each predictor's share of the
oracle's mean-latency gain. The trivial
baseline is fcfs itself (sjf on a constant guess is fcfs: ties keep arrival order).

    .venv/bin/python scripts/studies/sjf_prompt_ceiling.py [--predictors default,smollm2,probe,prompt-oracle] [--split test]
        [--burst 1000] [--max-batch 64] [--json runs/sjf_prompt_ceiling.json]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from odma.analyze.experiment import ExperimentSpec, run_experiment
from odma.analyze.replay import EngineSpec
from odma.analyze.workload import WorkloadSpec
from odma.trace_records import Trace, split_trace
from odma.traces import load_trace

FAMILIES = {  # smollm2-answers `type` values per prompt family
    "alpaca": ("alpaca-demo", "helpful_base", "koala", "oasst", "selfinstruct", "vicuna"),
    "sharegpt": (None,),
    "nq": ("nq",),
}
KEYS = ("latency_mean_s", "ttft_p50_s", "latency_p99_s", "throughput_tps", "completed", "makespan_s")


def multi_sample_trace(answers: Trace, family: str, min_samples: int) -> Trace:
    by_prompt = defaultdict(list)
    for record in answers.records:
        if record.type in FAMILIES[family]:
            by_prompt[record.prompt].append(record)
    records = [r for group in by_prompt.values() if len(group) >= min_samples for r in group]
    return Trace(f"{answers.name}/{family}", records, answers.tokenizer, dict(answers.meta))


def replay(trace: Trace, args, predictor: str, order: str) -> dict:
    policy = "odma/predict=oracle" if predictor == "oracle" else "odma"
    spec = ExperimentSpec(trace=trace.name, policies=policy, predictor=None if predictor == "oracle" else predictor,
                          profile=args.profile,
                          workload=WorkloadSpec(requests=args.burst, max_new_tokens=512,
                                                seed=args.seed),
                          engine=EngineSpec(max_batch=args.max_batch, max_prefill_tokens=2048, scheduler="engine",
                                            schedule=order, sjf_aging_rounds=args.aging_rounds))
    row = run_experiment(spec, trace=trace)["policies"][policy]
    return {k: row.get(k) for k in KEYS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="alpaca,sharegpt,nq")
    p.add_argument("--predictors", default="default,smollm2,probe,prompt-oracle,prompt-oracle:with-own", help="besides the oracle, which always runs")
    p.add_argument("--split", default="all", choices=("all", "train", "val", "test"),
                   help="test: only prompts no shipped predictor trained on")
    p.add_argument("--min-samples", type=int, default=5)
    p.add_argument("--burst", type=int, default=1000)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--aging-rounds", type=int, default=512)
    p.add_argument("--profile", default="cpu-smollm2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="runs/sjf_prompt_ceiling.json")
    args = p.parse_args()
    predictors = ["oracle", *[x for x in args.predictors.split(",") if x and x != "oracle"]]
    result = {"args": vars(args), "families": {}}
    lines = ["| family | prompts × answers | predictor | fcfs mean latency s | sjf ÷ fcfs: mean latency | TTFT p50 | "
             "p99 latency | tok/s | share of the oracle's mean gain |", "|---|---|---|---|---|---|---|---|---|"]
    answers = load_trace("smollm2-answers")
    if args.split != "all":  # the same prompt-hash split the predictors were trained on
        answers = getattr(split_trace(answers), args.split)
    for family in args.families.split(","):
        trace = multi_sample_trace(answers, family, args.min_samples)
        prompts = len({r.prompt for r in trace.records})
        out = result["families"][family] = {"answers": len(trace.records), "prompts": prompts}
        oracle_gain = None
        for name in predictors:
            # each predictor's sjf against fcfs with its own reservations: only the order differs
            fcfs, sjf = replay(trace, args, name, "fcfs"), replay(trace, args, name, "sjf")
            gain = 1 - sjf["latency_mean_s"] / fcfs["latency_mean_s"]
            oracle_gain = gain if name == "oracle" else oracle_gain
            share = gain / oracle_gain if oracle_gain else float("nan")
            out[name] = {"fcfs": fcfs, "sjf": sjf, "share_of_oracle_gain": share}
            ratios = [sjf[k] / fcfs[k] for k in ("latency_mean_s", "ttft_p50_s", "latency_p99_s", "throughput_tps")]
            lines.append(f"| {family} | {prompts} × {len(trace.records) / prompts:.1f} | {name} | {fcfs['latency_mean_s']:.1f} | "
                         + " | ".join(f"{r:.2f}" for r in ratios) + f" | {share:.0%} |")
            print(lines[-1], flush=True)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
