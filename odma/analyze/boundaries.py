"""Bucket-boundary drift over a trace, through the real `BucketManager`.

Lengths are fed in trace order to a manager (observe → refresh every `step` completions over a sliding
window of `window`); after each refresh, the next `step` requests are placed with the new bounds, as a
server would place them, and we record per-bucket occupancy and internal fragmentation
(1 − Σ realized / Σ bound). Lengths above the top bound go to the large bucket (bound = max_new_tokens).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from odma.kv import BucketManager
from odma.config import BucketConfig
from odma.errors import ConfigError


@dataclass(frozen=True, slots=True)
class BoundarySpec:
    buckets: int = 8
    window: int = 2000
    step: int = 256  # requests between refreshes (the manager's refresh_every_n)
    align: int = 16
    max_new_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.buckets < 1 or self.window < 1 or self.step < 1 or self.max_new_tokens < 1:
            raise ConfigError("buckets, window, step and max_new_tokens must be >= 1")


def drift(lengths: list[int], spec: BoundarySpec, method: str) -> dict:
    """Bounds after each refresh and how the following requests fill them."""
    mgr = BucketManager(
        BucketConfig(
            max_buckets=spec.buckets, align=spec.align, window=spec.window, min_samples=min(64, spec.window),
            refresh_every_n=spec.step, refresh_every_s=math.inf, method=method, large_bound=spec.max_new_tokens,
        )
    )
    lengths = [min(max(1, x), spec.max_new_tokens) for x in lengths]
    epochs = []
    for start in range(0, len(lengths), spec.step):
        bounds = mgr.bounds
        chunk = lengths[start : start + spec.step]
        counts = [0] * (len(bounds) + 1)  # last: the large bucket
        realized = [0] * (len(bounds) + 1)
        reserved = [0] * (len(bounds) + 1)
        for x in chunk:
            i = bisect.bisect_left(bounds, x)
            counts[i] += 1
            realized[i] += x
            reserved[i] += bounds[i] if i < len(bounds) else spec.max_new_tokens
        epochs.append({
            "start": start,
            "bounds": list(bounds),
            "occupancy": [c / len(chunk) for c in counts],
            "fragmentation": [1 - r / s if s else None for r, s in zip(realized, reserved)],
            "efficiency": sum(realized) / sum(reserved),
        })
        for x in chunk:
            mgr.observe(x)
        if mgr.refresh_due():
            mgr.refresh()
    return {"method": method, "epochs": epochs, "mean_efficiency": _weighted_efficiency(lengths, epochs, spec)}


def _weighted_efficiency(lengths: list[int], epochs: list[dict], spec: BoundarySpec) -> float:
    realized = reserved = 0
    for e in epochs:
        bounds = e["bounds"]
        for x in lengths[e["start"] : e["start"] + spec.step]:
            i = bisect.bisect_left(bounds, x)
            realized += x
            reserved += bounds[i] if i < len(bounds) else spec.max_new_tokens
    return realized / max(1, reserved)


def analyze(lengths: list[int], spec: BoundarySpec, methods=("quantile", "optimal")) -> dict:
    if not lengths:
        raise ConfigError("boundary analysis needs a trace with output lengths")
    return {"spec": {k: getattr(spec, k) for k in spec.__slots__}, "requests": len(lengths),
            "methods": {m: drift(lengths, spec, m) for m in methods}}


def plot(result: dict, path: str, title: str) -> None:
    """Bounds over the trace, per-bucket occupancy and fragmentation, one column per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(result["methods"].values())
    fig, axes = plt.subplots(3, len(methods), figsize=(6 * len(methods), 10), squeeze=False)
    for col, m in enumerate(methods):
        epochs = m["epochs"]
        xs = [e["start"] for e in epochs]
        k = max(len(e["bounds"]) for e in epochs)
        ax = axes[0][col]
        for i in range(k):
            ax.plot(xs, [e["bounds"][i] if i < len(e["bounds"]) else math.nan for e in epochs], label=f"b{i}")
        ax.set_title(f"{m['method']}: bounds (efficiency {m['mean_efficiency']:.3f})")
        ax.set_ylabel("output tokens")
        ax.set_yscale("log")
        ax.legend(fontsize=7, ncol=2)
        ax = axes[1][col]
        occ = [[e["occupancy"][i] if i < len(e["occupancy"]) - 1 else 0.0 for e in epochs] for i in range(k)]
        occ.append([e["occupancy"][-1] for e in epochs])
        ax.stackplot(xs, occ, labels=[f"b{i}" for i in range(k)] + ["large"])
        ax.set_title("occupancy of the next requests")
        ax.set_ylim(0, 1)
        ax = axes[2][col]
        for i in range(k):
            ax.plot(xs, [_at(e["fragmentation"], i, len(e["bounds"])) for e in epochs], label=f"b{i}")
        ax.set_title("internal fragmentation (1 - realized / bound)")
        ax.set_xlabel("request index")
        ax.set_ylim(0, 1)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _at(values: list, i: int, n_bounds: int) -> float:
    v = values[i] if i < n_bounds else None
    return math.nan if v is None else v
