"""odma's memory policy under pressure, in the fitted GPU replay: each change alone and together, on both traces and
both budgets (docs/results/gpu/replay_policy.md).

Every variant is the bench's burst (`odma.analyze.gpu_burst.run_burst`) with EngineConfig fields changed; its
seconds come from the shipped H200 and H100 profiles, and its tok/s is divided by paged's on the same profile.

    .venv/bin/python scripts/studies/gpu_policy.py --variants swap,compact,headroom --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from odma.analyze.gpu_burst import GIB, BurstConfig, bench_prompts, odma_memory, run_burst  # noqa: E402
from odma.analyze.gpu_profile import load_gpu_profile  # noqa: E402
from odma.config import PoolConfig  # noqa: E402

PROFILES = ("h200-7b", "h100-7b")


def _compact(**pool) -> PoolConfig:
    return replace(PoolConfig(), compact_growth=True, **pool)


# name -> (base policy, EngineConfig overrides, oracle: every request tagged with its true length)
VARIANTS = {
    "static": ("static", {}, False),
    "paged": ("paged", {}, False),
    "swap": ("odma", {}, False),  # the engine's defaults: what the first GPU runs did
    "compact": ("odma", odma_memory("compact"), False),
    "theta0.9": ("odma", {"admission_theta": 0.9}, False),
    "wait": ("odma", {"preempt": "wait"}, False),
    "compact+theta0.9": ("odma", {"pool": _compact(), "admission_theta": 0.9}, False),
    "compact+wait": ("odma", odma_memory("compact-wait"), False),
    "wait+theta0.9": ("odma", {"preempt": "wait", "admission_theta": 0.9}, False),
    "headroom": ("odma", odma_memory("headroom"), False),  # compaction + wait + θ 0.9
}


def run(name: str, trace: str, gib: float, prompts) -> dict:
    policy, overrides, oracle = VARIANTS[name]
    config = BurstConfig(trace=trace, kv_budget_bytes=int(gib * GIB))
    burst = run_burst(config, policy, engine_overrides=overrides, oracle=oracle, prompts=prompts)
    row = {"variant": name, "trace": trace, "kv_gib": gib, **burst.summary()}
    for p in PROFILES:
        parts = load_gpu_profile(p).breakdown(burst.steps, burst.paged)
        row[p] = {"tokens_per_s": burst.output_tokens / parts["seconds"], **parts}
    return row


def table(rows: list[dict], names: list[str]) -> str:
    cfgs = [("azure-conv", 4.0), ("azure-conv", 16.0), ("sharegpt-chat", 4.0), ("sharegpt-chat", 16.0)]
    at = {(r["variant"], r["trace"], r["kv_gib"]): r for r in rows}

    def ratio(r, base, p):
        return r[p]["tokens_per_s"] / base[p]["tokens_per_s"]

    out = ["| change | Azure 4 GiB | Azure 16 GiB | ShareGPT 4 GiB | ShareGPT 16 GiB | preemptions (A4/A16/S4/S16) | "
           "migrations (A4/S4) | migrated tokens (A4/S4) | relocated tokens (A4/S4) | ÷ static (A4, H100) |",
           "|---|---:|---:|---:|---:|---|---|---|---|---:|"]
    for n in names:
        if not all((n, t, g) in at for t, g in cfgs):
            continue
        cells = [f"{ratio(at[n, t, g], at['paged', t, g], 'h200-7b'):.3f} / {ratio(at[n, t, g], at['paged', t, g], 'h100-7b'):.3f}"
                 for t, g in cfgs]
        pre = "/".join(str(at[n, t, g]["preemptions"]) for t, g in cfgs)
        a, s = at[n, "azure-conv", 4.0], at[n, "sharegpt-chat", 4.0]
        static = at.get(("static", "azure-conv", 4.0))
        vs_static = f"{ratio(a, static, 'h100-7b'):.2f}" if static else ""
        out.append(f"| {n} | " + " | ".join(cells) + f" | {pre} | {a['migrations']:,}/{s['migrations']:,} | "
                   f"{a['migrated_tokens']:,}/{s['migrated_tokens']:,} | {a['relocated_tokens']:,}/{s['relocated_tokens']:,} "
                   f"| {vs_static} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--traces", default="azure-conv,sharegpt-chat")
    p.add_argument("--kv-gib", default="4,16")
    p.add_argument("--json", help="write every row here")
    args = p.parse_args()
    names = [n for n in args.variants.split(",") if n]
    unknown = set(names) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}")
    rows = []
    for trace in args.traces.split(","):
        for gib in (float(g) for g in args.kv_gib.split(",")):
            prompts = bench_prompts(BurstConfig(trace=trace, kv_budget_bytes=int(gib * GIB)))
            for name in dict.fromkeys(["paged", "static", *names]):
                t = time.time()
                rows.append(run(name, trace, gib, prompts))
                r = rows[-1]
                print(f"{trace} {gib:g} GiB {name}: {r['h200-7b']['tokens_per_s']:.0f} tok/s (H200), steps {r['steps']}, "
                      f"running {r['mean_running']}, preemptions {r['preemptions']} ({time.time() - t:.1f} s)", flush=True)
    print(table(rows, list(dict.fromkeys(["static", *names]))))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
