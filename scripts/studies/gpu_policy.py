"""odma's memory policy under pressure, in the fitted GPU replay: each change alone and together, on both traces and
both budgets (docs/results/gpu/replay_policy.md).

Every variant is the bench's burst (`odma.analyze.gpu_burst.run_burst`) with EngineConfig fields changed; its
seconds come from the shipped H200 and H100 profiles, and its tok/s is divided by paged's on the same profile.

    .venv/bin/python scripts/studies/gpu_policy.py --variants swap,compact,packed --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from odma.analyze.gpu_burst import bench_prompts, odma_memory, run_burst, study_config  # noqa: E402
from odma.analyze.gpu_profile import load_gpu_profile  # noqa: E402
from odma.config import PoolConfig  # noqa: E402
from odma.engine.config import PACKED_THETA  # noqa: E402

PROFILES = ("h200-7b", "h100-7b")


def _pool(**fields) -> PoolConfig:
    return replace(PoolConfig(), **fields)


PACKED_POOL = dict(compact_growth=True, slide_growth=True, neighbour_growth=True, growth="step")


@functools.cache
def _profile(name: str):
    """A shipped GPU profile, read once per run of the study."""
    return load_gpu_profile(name)


def _packed_without(*names: str, **engine) -> dict:
    """Packing's fields (its pool, θ, waiting) with `names` of them off (growth back to "next"), and `engine` fields
    changed."""
    pool = {k: v for k, v in PACKED_POOL.items() if k not in names}
    if "compact_growth" in names:
        pool.pop("slide_growth", None)
    return {"packing": False, "pool": _pool(**pool), "admission_theta": PACKED_THETA, "preempt": "wait", **engine}


def _packed_scaled(scale: float, **engine) -> dict:
    """Packing as the engine sets it, reserving for scale·L̂ (PoolConfig.reserve_scale; 0.5 by default)."""
    packed = odma_memory("packed")
    return {**packed, "pool": replace(packed["pool"], reserve_scale=scale), **engine}


def _packed_continuing(**engine) -> dict:
    """Packing as the engine sets it, with blocks that cannot grow continued in new ones (PoolConfig.continue_growth)."""
    return {**odma_memory("packed", continue_growth=True), **engine}


# name -> (base policy, EngineConfig overrides, lengths: "median" (the bench's running median), "oracle" (every
# request tagged with its true length) or "default" (the learned predictor, from the trace's texts: ShareGPT only))
VARIANTS = {
    "static": ("static", {}, "median"),
    "paged": ("paged", {}, "median"),
    "swap": ("odma", {}, "median"),  # the engine's CPU defaults: what the first GPU runs did
    # each change alone
    "compact": ("odma", odma_memory("compact"), "median"),
    "slide": ("odma", {"pool": _pool(compact_growth=True, slide_growth=True)}, "median"),
    "neighbours": ("odma", {"pool": _pool(neighbour_growth=True)}, "median"),
    "step64": ("odma", {"pool": _pool(growth="step")}, "median"),
    "double": ("odma", {"pool": _pool(growth="double")}, "median"),
    "theta0.97": ("odma", {"admission_theta": PACKED_THETA}, "median"),
    "theta0.9": ("odma", {"admission_theta": 0.9}, "median"),
    "wait": ("odma", {"preempt": "wait"}, "median"),
    "recompute": ("odma", {"preempt": "recompute"}, "median"),
    "sjf": ("odma", {"schedule": "sjf"}, "median"),  # also preempts the request with the most predicted work left
    # together
    "headroom": ("odma", odma_memory("headroom"), "median"),  # compaction + wait + θ 0.9
    "packed": ("odma", odma_memory("packed"), "median"),  # compaction + sliding + neighbours + step + θ 0.97 + wait
    "packed-swap": ("odma", odma_memory("packed-swap"), "median"),  # the first packed GPU runs: a swap, not a wait
    # each change alone on the first packed runs' policy (what preempted 12 of 200 ShareGPT first turns)
    "packed-swap+theta0.95": ("odma", _packed_without(preempt="swap", admission_theta=0.95), "median"),
    "packed-swap+demand0.9": ("odma", _packed_without(preempt="swap", admission_demand=0.9), "median"),
    "packed-swap+sjf": ("odma", _packed_without(preempt="swap", schedule="sjf"), "median"),
    "packed-swap+recompute": ("odma", _packed_without(preempt="recompute"), "median"),
    "packed-slide": ("odma", _packed_without("slide_growth"), "median"),
    "packed-neighbours": ("odma", _packed_without("neighbour_growth"), "median"),
    "packed-step": ("odma", _packed_without("growth"), "median"),
    "packed-theta": ("odma", _packed_without(admission_theta=1.0), "median"),
    "packed+theta0.99": ("odma", _packed_without(admission_theta=0.99), "median"),
    "packed+double": ("odma", {**_packed_without(), "pool": _pool(**{**PACKED_POOL, "growth": "double"})}, "median"),
    "packed+sjf": ("odma", _packed_without(schedule="sjf"), "median"),
    "packed+demand1.0": ("odma", _packed_without(admission_demand=1.0), "median"),
    # without copying shared prompt prefixes (the engine's paged pool has none): the ratio on equal terms where a
    # burst's prompts share prefixes (ShareGPT chat turns sent with their history, `sharegpt-chat:400:bench`)
    "static-noprefix": ("static", {"prefix_share_min_tokens": 0}, "median"),
    "paged-noprefix": ("paged", {"prefix_share_min_tokens": 0}, "median"),  # the paged pool before it mapped prefixes
    "packed-noprefix": ("odma", {**odma_memory("packed"), "prefix_share_min_tokens": 0}, "median"),
    # shared prefixes read in place (odma.kv.shared_rows) instead of copied
    "packed+reads": ("odma", {**odma_memory("packed"), "prefix_reads": True}, "median"),
    "L:packed+reads": ("odma", {**odma_memory("packed"), "prefix_reads": True}, "default"),
    # a block that cannot grow goes on in a new block, its rows so far read where they are (PoolConfig.continue_growth)
    "packed+continue": ("odma", _packed_continuing(), "median"),
    "packed+reads+continue": ("odma", _packed_continuing(prefix_reads=True), "median"),
    "L:packed+reads+continue": ("odma", _packed_continuing(prefix_reads=True), "default"),
    "O:packed+reads+continue": ("odma", _packed_continuing(prefix_reads=True), "oracle"),
    "L:packed+continue": ("odma", _packed_continuing(), "default"),
    "O:packed+continue": ("odma", _packed_continuing(), "oracle"),
    # with both, the learned encoder's reservations and order (the running median's say nothing: one guess for all),
    # and exact lengths' (what any predictor could buy there)
    **{f"{tag}packed+reads+continue+{order}+scale{s:g}": (
        "odma", {**_packed_continuing(prefix_reads=True, schedule=order),
                 "pool": replace(odma_memory("packed", continue_growth=True)["pool"], reserve_scale=s)}, lengths)
       for tag, lengths in (("L:", "default"), ("O:", "oracle"))
       for order in ("fcfs", "sjf", "adaptive") for s in (0.125, 0.25)},
    # exact lengths instead of the running median's guess
    "oracle": ("oracle", {}, "median"),  # contiguous blocks of exactly the true length, never growing
    "O:packed": ("odma", odma_memory("packed"), "oracle"),
    "O:packed+demand1.0": ("odma", _packed_without(admission_demand=1.0), "oracle"),
    "O:packed+sjf": ("odma", _packed_without(schedule="sjf"), "oracle"),
    "O:packed+scale1": ("odma", {**_packed_without(), "pool": _pool(**PACKED_POOL, reserve_scale=1.0)}, "oracle"),
    "L:swap": ("odma", {}, "default"),
    "L:compact": ("odma", odma_memory("compact"), "default"),
    "L:packed": ("odma", odma_memory("packed"), "default"),
    "L:packed+demand1.0": ("odma", _packed_without(admission_demand=1.0), "default"),
    "L:packed+sjf": ("odma", _packed_without(schedule="sjf"), "default"),
    # how much of L̂ a block reserves up front: the rest is grown into (by copy) when the request gets there
    **{f"{tag}packed+scale{s:g}": ("odma", _packed_scaled(s), lengths)
       for tag, lengths in (("", "median"), ("O:", "oracle"), ("L:", "default")) for s in (0.125, 0.25, 0.75, 1.0)},
    # the order of service by predicted remaining length (ordering.py), with smaller reservations
    **{f"{tag}packed+{order}{f'+scale{s:g}' if s != 0.5 else ''}": ("odma", _packed_scaled(s, schedule=order), lengths)
       for tag, lengths in (("", "median"), ("O:", "oracle"), ("L:", "default"))
       for order in ("sjf", "adaptive") for s in (0.125, 0.25, 0.5) if (order, s) != ("sjf", 0.5)},  # above
}


def run(name: str, trace: str, gib: float, prompts) -> dict:
    policy, overrides, lengths = VARIANTS[name]
    config = study_config(trace, gib)
    burst = run_burst(config, policy, engine_overrides=overrides, oracle=lengths == "oracle", prompts=prompts,
                      predictor=None if lengths in ("median", "oracle") else lengths)
    row = {"variant": name, "trace": trace, "kv_gib": gib, **burst.summary()}
    for p in PROFILES:
        profile = _profile(p)
        parts = profile.breakdown(burst.steps, burst.paged)
        # bounds for what the replay does not charge, reading rows through pieces: the decode context of requests
        # that read pieces at the paged pool's cost (pieces are a few long runs, not pages: this over-charges), and
        # every context token of every step at that cost (the coarser bound first quoted)
        piece_context = sum(s.piece_context for s in burst.steps)
        pieces = parts["seconds"] + profile.ms_per_1k_context * (profile.paged_read_factor - 1) * piece_context / 1e6
        as_pages = parts["seconds"] - parts["device_s"] + sum(profile.device_ms(s, True) for s in burst.steps) / 1e3
        row[p] = {"tokens_per_s": burst.output_tokens / parts["seconds"], **parts,
                  "piece_context": piece_context,
                  "tokens_per_s_pieces_as_pages": burst.output_tokens / pieces,
                  "tokens_per_s_read_as_pages": burst.output_tokens / as_pages}
    return row


def _break_even(r: dict, base: dict | None, profile: str) -> float:
    """The piece-read cost (× a contiguous read) at which `r` takes as long as `base`: the replay charges a piece's
    context at a contiguous read's ms per 1K tokens, so each further unit of cost adds that much again."""
    if base is None:
        return float("nan")
    per_unit = _profile(profile).ms_per_1k_context * r[profile]["piece_context"] / 1e6
    return 1 + (base[profile]["seconds"] - r[profile]["seconds"]) / per_unit


def _ratio(r: dict, base: dict, profile: str) -> float:
    return r[profile]["tokens_per_s"] / base[profile]["tokens_per_s"]


def table(rows: list[dict], names: list[str]) -> str:
    """One row per variant: ÷ paged (H200 / H100) on every trace and budget, and its counts at the smallest budget
    (one value per trace, `;` between them)."""
    cfgs = list(dict.fromkeys((r["trace"], r["kv_gib"]) for r in rows))
    small = [c for c in cfgs if c[1] == min(g for _, g in cfgs)]
    at = {(r["variant"], r["trace"], r["kv_gib"]): r for r in rows}
    labels = [f"{t.split(':')[0]} {g:g} GiB" for t, g in cfgs]
    out = ["| change | " + " | ".join(labels) + f" | preemptions ({', '.join(labels)}) | steps, running | migrations | "
           "relocated tokens | ÷ static (H200) |",
           "|---|" + "---:|" * len(cfgs) + "---|---|---|---|---|"]
    for n in names:
        if not any((n, t, g) in at for t, g in cfgs):
            continue
        cells = [f"{_ratio(at[n, t, g], at['paged', t, g], 'h200-7b'):.3f} / "
                 f"{_ratio(at[n, t, g], at['paged', t, g], 'h100-7b'):.3f}"
                 if (n, t, g) in at and ("paged", t, g) in at else "–" for t, g in cfgs]
        pre = "/".join(str(at[n, t, g]["preemptions"]) if (n, t, g) in at else "–" for t, g in cfgs)
        xs = [at.get((n, t, g)) for t, g in small]
        statics = [at.get(("static", t, g)) for t, g in small]

        def each(fmt, xs=xs) -> str:
            return "; ".join(fmt(x) if x else "–" for x in xs)

        running = each(lambda x: f"{x['steps']:,}, {x['mean_running']}")
        migrations = each(lambda x: f"{x['migrations']:,}")
        relocated = each(lambda x: f"{x['relocated_tokens']:,}")
        vs_static = "; ".join(f"{_ratio(x, s, 'h200-7b'):.2f}" if x and s else "–" for x, s in zip(xs, statics))
        out.append(f"| {n} | " + " | ".join(cells) + f" | {pre} | {running} | {migrations} | {relocated} | {vs_static} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--traces", default="azure-conv,sharegpt-chat,sharegpt:200:bench",
                   help="NAME[:REQUESTS][:bench] each (odma.analyze.gpu_burst.study_config; default: %(default)s)")
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
            prompts = bench_prompts(study_config(trace, gib))
            for name in dict.fromkeys(["paged", "static", *names]):
                if VARIANTS[name][2] == "default" and trace.startswith("azure"):
                    continue  # Azure's trace has no texts for the learned predictor
                t = time.time()
                rows.append(run(name, trace, gib, prompts))
                r = rows[-1]
                print(f"{trace} {gib:g} GiB {name}: {r['h200-7b']['tokens_per_s']:.0f} tok/s (H200), steps {r['steps']}, "
                      f"running {r['mean_running']}, preemptions {r['preemptions']} ({time.time() - t:.1f} s)", flush=True)
    print(table(rows, list(dict.fromkeys(["static", *names]))))
    print("\nWith the context read through pieces, then every context token, at the paged pool's cost (bounds for "
          "pieces), ÷ paged, H200:")
    at = {(r["variant"], r["trace"], r["kv_gib"]): r for r in rows}
    for r in rows:
        base = at.get(("paged", r["trace"], r["kv_gib"]))
        if r["variant"] not in ("paged", "static") and base:
            h200, paged = r["h200-7b"], base["h200-7b"]["tokens_per_s"]
            print(f"  {r['variant']} {r['trace']} {r['kv_gib']:g} GiB: "
                  f"{h200['tokens_per_s_pieces_as_pages'] / paged:.3f}, {h200['tokens_per_s_read_as_pages'] / paged:.3f}")
    print("\nBreak-even: how many times a contiguous read a piece read may cost before the variant falls to packing "
          "(the default), then to paged, H200 / H100:")
    for r in rows:
        if r["variant"] not in ("paged", "static") and r["h200-7b"]["piece_context"]:
            cells = [" / ".join(f"{_break_even(r, at.get((base, r['trace'], r['kv_gib'])), p):.2f}" for p in PROFILES)
                     for base in ("packed", "paged")]
            print(f"  {r['variant']} {r['trace']} {r['kv_gib']:g} GiB: {cells[0]}; {cells[1]}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
