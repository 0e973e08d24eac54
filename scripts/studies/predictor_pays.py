"""Does the predictor pay? (docs/BENCHMARKS.md): the same replays with the predictor, the best constant guess and
the oracle, side by side in one run, through the engine's own scheduler (`odma-analyze replay --scheduler engine`).

    .venv/bin/python scripts/studies/predictor_pays.py [--traces sharegpt,azure-conv,alpaca,nq] [--predictor default]
        [--requests 3000] [--max-batch 64] [--out runs/pays]

1. Offline (all requests at t=0): throughput and migrations of `odma` with the predictor's L̂, with a constant
   guess of 32 / 64 / 128 / 256 tokens and with the realized length (oracle), each with and without a growth
   hint (`/hint=pred`: the first growth goes straight to the bucket holding L̂). "Best constant" = the constant
   (and hint setting) with the highest throughput, ties broken by fewer migrations.
2. Load sweep: Poisson arrivals at 70 / 90 / 110 % of the offline capacity (requests/s of `odma` with the
   predictor), fcfs against sjf, for the predictor, the best constant and the oracle: throughput, TTFT p50, mean
   and p99 latency.
Writes OUT/pays.json and OUT/pays.md (Markdown tables) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from odma.analyze.experiment import ExperimentSpec, run_experiment
from odma.analyze.replay import EngineSpec
from odma.analyze.workload import WorkloadSpec
from odma.traces import load_trace

CONSTANTS = (32, 64, 128, 256)
LOADS = (0.7, 0.9, 1.1)
KEYS = ("throughput_tps", "migrations", "copied_tokens", "ttft_p50_s", "latency_mean_s", "latency_p99_s", "lost")


def policies(hint: bool) -> list[str]:
    suffix = "/hint=pred" if hint else ""
    return [f"odma{suffix}", *(f"odma/predict={c}{suffix}" for c in CONSTANTS), f"odma/predict=oracle{suffix}"]


def offline(trace, args) -> dict:
    spec = ExperimentSpec(trace=trace.name, policies=",".join(policies(False) + policies(True)),
                          predictor=args.predictor, profile=args.profile,
                          workload=WorkloadSpec(requests=args.requests, split=args.split),
                          engine=EngineSpec(max_batch=args.max_batch, scheduler="engine"))
    rows = run_experiment(spec, trace=trace)["policies"]
    return {name: {k: r.get(k) for k in KEYS} | {"requests_per_s": r["completed"] / r["makespan_s"]}
            for name, r in rows.items()}


def best_constant(rows: dict) -> str:
    constants = [n for n in rows if "/predict=" in n and "oracle" not in n]
    return max(constants, key=lambda n: (round(rows[n]["throughput_tps"], 1), -rows[n]["migrations"]))


def sweep(trace, args, capacity: float, names: list[str]) -> dict:
    out = {}
    for load in LOADS:
        for order in ("fcfs", "sjf"):
            spec = ExperimentSpec(trace=trace.name, policies=",".join(names), predictor=args.predictor,
                                  profile=args.profile,
                                  workload=WorkloadSpec(requests=args.requests, split=args.split, arrivals="poisson",
                                                        rate=capacity * load, seed=args.seed),
                                  engine=EngineSpec(max_batch=args.max_batch, scheduler="engine", schedule=order,
                                                    sjf_aging_rounds=args.aging_rounds))
            rows = run_experiment(spec, trace=trace)["policies"]
            out[f"{load}/{order}"] = {n: {k: rows[n].get(k) for k in KEYS} for n in names}
    return out


def markdown(name: str, off: dict, best: str, loads: dict, names: list[str]) -> str:
    lines = [f"**{name}** — offline", "", "| policy | tok/s | migrations | copied tokens |", "|---|---|---|---|"]
    for n, r in off.items():
        mark = " (best constant)" if n == best else ""
        lines.append(f"| {n}{mark} | {r['throughput_tps']:.0f} | {r['migrations']} | {r['copied_tokens']} |")
    lines += ["", f"**{name}** — Poisson load, fcfs → sjf", "",
              "| load | policy | tok/s fcfs / sjf | TTFT p50 s | mean latency s | p99 latency s |", "|---|---|---|---|---|---|"]
    for load in LOADS:
        for n in names:
            f, s = loads[f"{load}/fcfs"][n], loads[f"{load}/sjf"][n]
            lines.append(f"| {load:.0%} | {n} | {f['throughput_tps']:.0f} / {s['throughput_tps']:.0f} | "
                         f"{f['ttft_p50_s']:.2f} → {s['ttft_p50_s']:.2f} | {f['latency_mean_s']:.1f} → "
                         f"{s['latency_mean_s']:.1f} ({s['latency_mean_s'] / f['latency_mean_s'] - 1:+.0%}) | "
                         f"{f['latency_p99_s']:.1f} → {s['latency_p99_s']:.1f} "
                         f"({s['latency_p99_s'] / f['latency_p99_s'] - 1:+.0%}) |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", default="sharegpt,azure-conv,alpaca,nq")
    p.add_argument("--predictor", default="default")
    p.add_argument("--profile", default="mlu370-qwen7b")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--split", default="test")
    p.add_argument("--max-batch", type=int, default=64, help="running requests at most (the server's max_num_seqs)")
    p.add_argument("--aging-rounds", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/pays")
    args = p.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result, pages = {"args": vars(args), "traces": {}}, []
    for name in args.traces.split(","):
        trace = load_trace(name)
        off = offline(trace, args)
        best = best_constant(off)
        base_hint = best.endswith("/hint=pred")
        names = ["odma/hint=pred" if base_hint else "odma", best, "odma/predict=oracle" + ("/hint=pred" if base_hint else "")]
        loads = sweep(trace, args, off["odma"]["requests_per_s"], names)
        result["traces"][name] = {"offline": off, "best_constant": best, "capacity_rps": off["odma"]["requests_per_s"],
                                  "loads": loads}
        pages.append(markdown(name, off, best, loads, names))
        print(pages[-1] + "\n", flush=True)
        (out_dir / "pays.json").write_text(json.dumps(result, indent=1) + "\n")
        (out_dir / "pays.md").write_text("\n\n".join(pages) + "\n")


if __name__ == "__main__":
    main()
