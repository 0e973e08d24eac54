"""odma-analyze: replay traces through the real allocator, study bucket boundaries, print the paper table."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from odma.analyze.experiment import ExperimentSpec, run_experiment
from odma.analyze.policies import DEFAULT_POLICIES, PRESETS
from odma.analyze.profiles import PROFILES
from odma.analyze.replay import SCHEDULERS, EngineSpec
from odma.analyze.workload import ARRIVALS, WorkloadSpec
from odma.engine.ordering import ORDERS
from odma.errors import OdmaError


def _add_experiment_args(p: argparse.ArgumentParser, with_trace: bool = True) -> None:
    if with_trace:
        p.add_argument("--trace", required=True,
                       help="trace name (alpaca, nq, sharegpt, azure-conv, ...) or JSONL path")
    p.add_argument("--predictor", default="noisy-oracle:0.8",
                   help="PATH | default | sklearn | oracle | noisy-oracle:SIGMA (default: %(default)s)")
    p.add_argument("--profile", default="mlu370-qwen7b",
                   help=f"{' | '.join(PROFILES)} | a profile JSON file (default: %(default)s)")
    p.add_argument("--random-access-ratio", type=float, help="B_rand/B_seq for paged KV reads (profile default 0.5)")
    p.add_argument("--budget-tokens", type=int, help="KV budget in tokens (default: from the profile)")
    p.add_argument("--no-decode-compute", action="store_true",
                   help="decode steps cost memory traffic only (no compute roof)")
    p.add_argument("--requests", type=int, help="replay this many requests (tiles the trace if it is shorter)")
    p.add_argument("--arrivals", choices=ARRIVALS, default="offline",
                   help="offline: all at t=0; trace: the trace's timestamps; poisson: --rate (default: %(default)s)")
    p.add_argument("--rate", type=float, help="Poisson arrival rate, requests per second")
    p.add_argument("--max-new-tokens", type=int, help="generation cap (default: the trace's cap, else 2048)")
    p.add_argument("--max-model-len", type=int, default=16384, help="prompt + max_new_tokens above this is refused")
    p.add_argument("--split", choices=("all", "train", "val", "test"), default="all",
                   help="replay only this split of the trace (by prompt hash, as the predictor was trained)")
    p.add_argument("--buckets", type=int, default=8, help="bucket count K")
    p.add_argument("--window", type=int, default=2000, help="realized lengths the dynamic buckets keep")
    p.add_argument("--refresh-every", type=int, default=256, help="completions between bucket refreshes")
    p.add_argument("--cold-start", action="store_true", help="dynamic buckets start without history")
    p.add_argument("--max-prefill-tokens", type=int, default=8192, help="prompt tokens prefilled per step")
    p.add_argument("--max-batch", type=int, default=0, help="running requests at most (0: memory decides)")
    p.add_argument("--on-full", choices=("auto", "stall", "preempt"), default="auto",
                   help="a request that cannot grow: stall, or preempt the newest (auto: preempt for paged only)")
    p.add_argument("--scheduler", choices=SCHEDULERS, default=None,
                   help="event: an event-driven approximation of the engine's scheduler (about 10x faster on large "
                        "replays, fcfs and whole prompts only); engine: the serving engine's own Scheduler, every "
                        "request advancing every step (default: engine with --schedule or --chunked-prefill, else "
                        "event)")
    p.add_argument("--schedule", choices=ORDERS, default=None,
                   help="the engine scheduler's order of service: fcfs, sjf (shortest predicted remaining first, "
                        "with aging) or adaptive (sjf while more wait than can run); implies --scheduler engine")
    p.add_argument("--chunked-prefill", action="store_true",
                   help="the engine scheduler feeds at most --max-prefill-tokens of prompts per step beside its decodes "
                        "(odma-serve's and vLLM's default); implies --scheduler engine")
    p.add_argument("--sjf-aging-rounds", type=int, default=256, help="sjf: rounds waited beyond the newest waiting request after which a request goes first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _experiment_spec(args: argparse.Namespace, trace: str, policies: str) -> ExperimentSpec:
    return ExperimentSpec(
        trace=trace,
        policies=policies,
        predictor=args.predictor,
        profile=args.profile,
        random_access_ratio=args.random_access_ratio,
        budget_tokens=args.budget_tokens,
        decode_compute_bound=not args.no_decode_compute,
        workload=WorkloadSpec(
            requests=args.requests, arrivals=args.arrivals, rate=args.rate, max_new_tokens=args.max_new_tokens,
            max_model_len=args.max_model_len, split=args.split, seed=args.seed,
        ),
        engine=EngineSpec(max_prefill_tokens=args.max_prefill_tokens, max_batch=args.max_batch, on_full=args.on_full,
                          scheduler=args.scheduler or ("engine" if args.schedule or args.chunked_prefill else "event"),
                          schedule=args.schedule or "fcfs", sjf_aging_rounds=args.sjf_aging_rounds,
                          chunked_prefill=args.chunked_prefill),
        buckets=args.buckets,
        window=args.window,
        refresh_every_n=args.refresh_every,
        cold_start=args.cold_start,
    )


def _write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def cmd_replay(args: argparse.Namespace) -> int:
    from odma.analyze.tables import format_experiment

    spec = _experiment_spec(args, args.trace, args.policies)
    timings: dict = {}
    result = run_experiment(spec, progress=not args.no_progress and sys.stderr.isatty(), timings=timings)
    _write_json(args.json, result)
    print(format_experiment(result))
    print("replay seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()), file=sys.stderr)
    return 0


def cmd_boundaries(args: argparse.Namespace) -> int:
    from odma.analyze.boundaries import BoundarySpec, analyze, plot
    from odma.traces import load_trace

    trace = load_trace(args.trace, limit=args.limit)
    max_new = args.max_new_tokens or int(trace.meta.get("length_cap") or 2048)
    spec = BoundarySpec(buckets=args.buckets, window=args.window, step=args.step, max_new_tokens=max_new)
    methods = ("quantile", "optimal") if args.method == "both" else (args.method,)
    result = analyze(trace.output_lengths(), spec, methods)
    result["trace"] = trace.name
    _write_json(args.json, result)
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(result, args.plot, f"{trace.name}: K={args.buckets}, window={args.window}, refresh every {args.step}")
    for name, m in result["methods"].items():
        first, last = m["epochs"][0]["bounds"], m["epochs"][-1]["bounds"]
        print(f"{name:9} reservation efficiency {m['mean_efficiency']:.3f}; bounds first {first} last {last}")
    return 0


def cmd_paper_table(args: argparse.Namespace) -> int:
    from odma.analyze.paper_table import format_paper_table, paper_table

    rows = paper_table(_experiment_spec(args, "alpaca", ""), progress=not args.no_progress and sys.stderr.isatty())
    _write_json(args.json, rows)
    print(format_paper_table(rows))
    return 0


def cmd_table(args: argparse.Namespace) -> int:
    from odma.analyze.tables import markdown_table

    policies = [p.strip() for p in args.policies.split(",")] if args.policies else None
    for path in args.results:
        result = json.loads(Path(path).read_text())
        w, pred = result["workload"], (result.get("predictor") or {}).get("source", "-")
        print(f"**{w['name']}** ({w['admissible']} requests, predictor {pred}, `{path}`)\n")
        try:
            print(markdown_table(result, policies) + "\n")
        except KeyError as exc:
            print(f"odma-analyze: {path}: {exc.args[0]}", file=sys.stderr)
            return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="odma-analyze", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("replay", help="replay a trace under several KV policies (the engine's scheduler, or its event-driven approximation)")
    _add_experiment_args(p)
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help=f"comma-separated: {', '.join(PRESETS)}, 'all', or NAME/key=value... (default: %(default)s)")
    p.add_argument("--json", help="write the full result here")
    p.set_defaults(func=cmd_replay)
    p = sub.add_parser("boundaries", help="bucket-boundary drift, occupancy and fragmentation over a trace")
    p.add_argument("--trace", required=True)
    p.add_argument("--buckets", type=int, default=8)
    p.add_argument("--window", type=int, default=2000)
    p.add_argument("--step", type=int, default=256, help="requests between refreshes")
    p.add_argument("--method", choices=("quantile", "optimal", "both"), default="both")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--limit", type=int, help="first N requests of the trace")
    p.add_argument("--plot", help="write a PNG here")
    p.add_argument("--json", help="write the full result here")
    p.set_defaults(func=cmd_boundaries)
    p = sub.add_parser("paper-table", help="alpaca and nq: static vs odma vs paged beside the ODMA paper's figures")
    _add_experiment_args(p, with_trace=False)
    p.add_argument("--json", help="write the rows here")
    # the real predictor on the held-out split it was not trained on (override with --predictor/--split)
    p.set_defaults(func=cmd_paper_table, predictor="default", split="test")
    p = sub.add_parser("table", help="Markdown tables from replay JSON files")
    p.add_argument("results", nargs="+", help="JSON files written by replay --json")
    p.add_argument("--policies", help="rows to show, in this order (default: all)")
    p.set_defaults(func=cmd_table)
    from odma.analyze.gpu_cli import add_parsers as add_gpu_parsers

    add_gpu_parsers(sub)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        code = args.func(args)
    except OdmaError as exc:
        print(f"odma-analyze: {exc}", file=sys.stderr)
        return 2
    print(f"done in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
