"""`odma-bench soak`'s verdict: per-minute latency percentiles, outcome counts, and the targets evaluated over the
sampled series; and the plot of it all. Pure bookkeeping over the soak's records (matplotlib only for the plot).

Targets (each `{"target", "measured", "pass"}`):
- `rss_growth`: the server's RSS at the end of the run at most 5 % above its RSS after the warm-up (the first 5
  minutes, or the first sixth of a shorter run), both read at idle points (the end of a load pause, or the end);
- `fds_flat`, `threads_flat`: open fds and threads at the idle points after the warm-up within 2 (or 1 %, for a
  tree of many processes such as Ray's) of each other (a client's keep-alive connection or a worker thread may
  come and go; a leak climbs past that);
- `gauges_zero_at_pauses`: queue, running and KV gauges 0 at the end of every pause and at the end;
- `lost`, `server_errors`: 0 (with a replica killed: its in-flight requests are counted apart, `killed_in_flight`);
- `p99_drift`: p99 latency of full answers in the last window at most 10 % above the first window's (10 minutes,
  or a sixth of a shorter run); a faster end passes.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from odma.bench.soak_load import FAILURES, OUTCOMES

RSS_GROWTH_MAX = 0.05
FLAT_SLACK = 2
P99_DRIFT_MAX = 0.10
ZERO_GAUGES = ("queue_depth", "running", "kv_reserved_bytes", "kv_live_bytes", "device_waiting")


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def windows(duration_s: float) -> tuple[float, float]:
    """(warm-up, comparison window) in seconds: 5 and 10 minutes, or a sixth of a run shorter than an hour."""
    return min(300.0, duration_s / 6), min(600.0, duration_s / 6)


def per_minute(outcomes: list[dict]) -> list[dict]:
    """For each minute of the run: outcome counts and latency / TTFT percentiles of its full answers."""
    minutes: dict[int, list[dict]] = {}
    for o in outcomes:
        minutes.setdefault(int(o["end_s"] // 60), []).append(o)
    rows = []
    for m in sorted(minutes):
        full = [o for o in minutes[m] if o["outcome"] == "full"]
        lat = [o["latency_s"] for o in full]
        ttft = [o["ttft_s"] for o in full if o.get("ttft_s") is not None]
        rows.append({"minute": m, "requests": len(minutes[m]), **dict(Counter(o["outcome"] for o in minutes[m])),
                     "latency_p50_s": pct(lat, 0.5), "latency_p90_s": pct(lat, 0.9), "latency_p99_s": pct(lat, 0.99),
                     "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
                     "completion_tokens": sum(o.get("tokens", 0) for o in full)})
    return rows


def outcome_counts(outcomes: list[dict]) -> dict:
    counts = {k: 0 for k in OUTCOMES}
    counts.update(Counter(o["outcome"] for o in outcomes))
    by_kind: dict[str, dict] = {}
    for o in outcomes:
        kind = "bad" if o["kind"].startswith("bad: ") else o["kind"]
        by_kind.setdefault(kind, Counter())[o["outcome"]] += 1
    reasons = Counter(f'{o.get("status")} {o["kind"]}: {o.get("reason", "")[:80]}' for o in outcomes
                      if o["outcome"] in ("rejected", *FAILURES))
    refused = [o for o in outcomes if o["outcome"] == "refused"]
    return {"total": len(outcomes), **counts, "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
            "refused_with_retry_after": sum(1 for o in refused if o.get("retry_after")),
            "reasons": dict(reasons.most_common(40))}


def _at_or_after(samples: list[dict], t: float) -> dict | None:
    return next((s for s in samples if s["t_s"] >= t), None)


def evaluate(samples: list[dict], idle: list[dict], outcomes: list[dict], duration_s: float,
             killed_in_flight: int = 0, skip: tuple[str, ...] = ()) -> dict:
    """The targets over the run (module docstring). `idle`: samples taken at the end of each pause and at the end;
    `skip`: targets that do not apply (a killed replica restarts processes, so RSS, fds and threads are moot)."""
    warm_s, window_s = windows(duration_s)
    targets: dict = {}
    # the server's whole process tree (vLLM's engine core, Ray's replicas are children of the process started)
    after = [s for s in idle if s["t_s"] >= warm_s and "rss_mb" in s]
    if len(after) >= 2 and "rss_growth" not in skip:
        base, end = after[0], after[-1]
        growth = _tree(end, "rss_mb") / _tree(base, "rss_mb") - 1
        targets["rss_growth"] = {"target": f"<= {RSS_GROWTH_MAX:.0%} from {base['t_s']:.0f} s to {end['t_s']:.0f} s",
                                 "measured": round(growth, 4), "from_mb": _tree(base, "rss_mb"),
                                 "to_mb": _tree(end, "rss_mb"),
                                 "peak_mb": max(_tree(s, "rss_mb") for s in samples if "rss_mb" in s),
                                 "pass": growth <= RSS_GROWTH_MAX}
    for key in ("fds", "threads"):
        if len(after) >= 2 and f"{key}_flat" not in skip:
            values = [_tree(s, key) for s in after]
            targets[f"{key}_flat"] = {"target": f"idle values after the warm-up within {FLAT_SLACK} (or 1 %) of each other",
                                      "measured": {"first": values[0], "last": values[-1], "min": min(values),
                                                   "max": max(values)},
                                      "pass": max(values) - min(values) <= max(FLAT_SLACK, 0.01 * max(values))}
    nonzero = [{"t_s": s["t_s"], **{g: s[g] for g in ZERO_GAUGES if s.get(g)}} for s in idle
               if any(s.get(g) for g in ZERO_GAUGES)]
    with_gauges = [s for s in idle if any(g in s for g in ZERO_GAUGES)]
    targets["gauges_zero_at_pauses"] = {"target": "queue, running and KV gauges 0 at every pause's end and the end",
                                        "measured": {"idle_points": len(with_gauges), "nonzero": nonzero[:20]},
                                        "pass": bool(with_gauges) and not nonzero}
    counts = Counter(o["outcome"] for o in outcomes)
    targets["lost"] = {"target": 0, "measured": counts["lost"], "pass": counts["lost"] == 0}
    targets["server_errors"] = {"target": 0, "measured": counts["server_error"], "pass": counts["server_error"] == 0}
    others = counts["bad_accepted"] + counts["unexpected_4xx"]
    targets["other_failures"] = {"target": "0 bad requests accepted, 0 good ones answered 4xx", "measured": others,
                                 "pass": others == 0}
    refused = [o for o in outcomes if o["outcome"] == "refused"]
    targets["refusals_say_retry_after"] = {"target": "every 429 has Retry-After", "measured": len(refused),
                                           "pass": all(o.get("retry_after") for o in refused)}
    if killed_in_flight or "killed_in_flight" in skip:
        targets["killed_in_flight"] = {"target": "counted apart (the killed replica's requests)",
                                       "measured": killed_in_flight, "pass": True}
    full = [o for o in outcomes if o["outcome"] == "full" and o["kind"] != "burst"]
    first = [o["latency_s"] for o in full if o["start_s"] < window_s]
    last = [o["latency_s"] for o in full if o["start_s"] >= duration_s - window_s]
    p_first, p_last = pct(first, 0.99), pct(last, 0.99)
    if p_first and p_last:
        drift = p_last / p_first - 1
        targets["p99_drift"] = {"target": f"last {window_s / 60:.1f} min's p99 latency <= first's + {P99_DRIFT_MAX:.0%}",
                                "measured": round(drift, 4), "first_p99_s": round(p_first, 3),
                                "last_p99_s": round(p_last, 3), "first_n": len(first), "last_n": len(last),
                                "load_first": _mean_load(samples, 0, window_s),
                                "load_last": _mean_load(samples, duration_s - window_s, duration_s),
                                "pass": drift <= P99_DRIFT_MAX}
    return targets


def _tree(sample: dict, key: str) -> float:
    return sample.get(f"tree_{key}", sample[key])


def _mean_load(samples: list[dict], a: float, b: float) -> float | None:
    xs = [s["load1"] for s in samples if a <= s["t_s"] < b and "load1" in s]
    return round(sum(xs) / len(xs), 2) if xs else None


def plot(result: dict, path: Path) -> None:
    """RSS, fds, threads, gauges, load and p50/p99 latency over time, with the pauses, bursts and a kill marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, idle = result["samples"], result["idle_samples"]
    fig, axes = plt.subplots(3, 2, figsize=(13, 10), sharex=True)

    def series(ax, key, label, scale=1.0, **kw):
        pts = [(s["t_s"] / 60, s[key] * scale) for s in samples if s.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), label=label, **kw)

    series(axes[0, 0], "rss_mb", "server RSS (MB)")
    series(axes[0, 0], "tree_rss_mb", "server + children RSS (MB)", ls="--")
    series(axes[0, 1], "fds", "open fds")
    series(axes[0, 1], "threads", "threads")
    if any(s.get("processes", 1) > 1 for s in samples):  # Ray's or vLLM's processes: the targets read the tree
        series(axes[0, 1], "tree_fds", "open fds, server + children", ls="--")
        series(axes[0, 1], "tree_threads", "threads, server + children", ls="--")
    series(axes[1, 0], "queue_depth", "queue depth")
    series(axes[1, 0], "running", "running")
    series(axes[1, 0], "in_flight", "client in flight", ls=":")
    series(axes[1, 1], "kv_reserved_bytes", "KV reserved (MiB)", 1 / 2**20)
    series(axes[1, 1], "kv_live_bytes", "KV live (MiB)", 1 / 2**20)
    series(axes[1, 1], "kv_usage", "KV usage (x100)", 100)
    rows = result["per_minute"]
    for key, label in (("latency_p50_s", "latency p50"), ("latency_p99_s", "latency p99"), ("ttft_p99_s", "TTFT p99")):
        pts = [(r["minute"] + 0.5, r[key]) for r in rows if r.get(key) is not None]
        if pts:
            axes[2, 0].plot(*zip(*pts), marker=".", label=label)
    series(axes[2, 1], "load1", "machine load average (1 min)")
    for ax, title in zip(axes.flat, ("memory", "fds and threads", "queue", "KV", "latency per minute (s)",
                                     "machine load (shared, 2 cores)")):
        ax.set_title(title, fontsize=10)
        for s in idle:
            ax.axvline(s["t_s"] / 60, color="0.85", lw=0.8, zorder=0)
        for b in result.get("bursts", []):
            ax.axvline(b["t_s"] / 60, color="tab:orange", lw=0.6, alpha=0.5, zorder=0)
        if result.get("kill"):
            ax.axvline(result["kill"]["t_s"] / 60, color="red", lw=1.2)
        ax.legend(fontsize=8, loc="best")
        ax.grid(alpha=0.3)
    for ax in axes[2]:
        ax.set_xlabel("minutes (grey: pause ends; orange: bursts; red: replica killed)")
    passed = sum(v["pass"] for v in result["targets"].values())
    fig.suptitle(f"odma-bench soak: {result['server']['kind']}, {result['duration_s'] / 60:.1f} min, "
                 f"{result['outcomes']['total']} requests, targets {passed}/{len(result['targets'])} met", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
