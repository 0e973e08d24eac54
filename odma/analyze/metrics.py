"""What a replay measures: running totals during the loop, and the JSON-ready summary after it."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from odma.kv import KVManager
from odma.analyze.policies import PolicySpec
from odma.analyze.predictions import Predictions
from odma.analyze.workload import Workload


@dataclass(slots=True)
class Totals:
    realized: int = 0  # Σ prompt + output at completion
    reserved: int = 0  # Σ capacity at completion
    realized_out: int = 0
    reserved_out: int = 0
    migrations: int = 0
    copied_tokens: int = 0
    migrated_requests: int = 0
    stall_steps: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    waited: int = 0
    sat_time: float = 0.0
    sat_live: float = 0.0  # ∫ live tokens dt over memory-bound steps
    sat_reserved: float = 0.0
    sat_running: float = 0.0
    sat_tokens: int = 0
    busy_time: float = 0.0
    busy_running: float = 0.0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)  # arrival → last token, per completed request


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _r(x: float) -> float:
    return float(f"{x:.6g}")


def summarize(workload: Workload, spec: PolicySpec, manager: KVManager, predictions: Predictions | None,
              t: Totals, completed: int, steps: int, last_finish: float) -> dict:
    """The JSON-ready metrics of one replay (definitions: docs/analyze.md)."""
    w, total = workload, manager.total_tokens
    first = w.items[0].arrival_s if w.items else 0.0
    makespan = max(last_finish - first, 1e-12)
    sat = t.sat_time
    out_tokens = sum(i.output_tokens for i in w.items)
    lost = w.arrivals - completed - w.refused
    return {
        "policy": spec.name,
        "kind": spec.kind,
        "predictor": predictions.source if predictions and spec.predict == "predictor" else spec.predict,
        "arrivals": w.arrivals,
        "completed": completed,
        "refused_admissions": w.refused,
        "lost": lost,
        "reservation_efficiency": _r(t.realized / max(1, t.reserved)),
        "output_reservation_efficiency": _r(t.realized_out / max(1, t.reserved_out)),
        "live_utilization": _r(t.sat_live / sat / total) if sat else None,
        "reserved_utilization": _r(t.sat_reserved / sat / total) if sat else None,
        "throughput_tps": _r(out_tokens / makespan),
        "saturated_tps": _r(t.sat_tokens / sat) if sat else None,
        "mean_concurrency": _r(t.sat_running / sat) if sat else _r(t.busy_running / max(t.busy_time, 1e-12)),
        "ttft_p50_s": _r(_pct(t.ttft, 0.5)),
        "ttft_p99_s": _r(_pct(t.ttft, 0.99)),
        "tpot_p50_s": _r(_pct(t.tpot, 0.5)),
        "tpot_p99_s": _r(_pct(t.tpot, 0.99)),
        "latency_mean_s": _r(sum(t.latency) / len(t.latency)) if t.latency else 0.0,
        "latency_p99_s": _r(_pct(t.latency, 0.99)),
        "overflow_rate": _r(t.migrated_requests / max(1, completed)),
        "migrations": t.migrations,
        "copied_tokens": t.copied_tokens,
        "stall_steps": t.stall_steps,
        "preemptions": t.preemptions,
        "recomputed_tokens": t.recomputed_tokens,
        "waited_for_memory": t.waited,
        "makespan_s": _r(makespan),
        "saturated_s": _r(sat),
        "steps": steps,
        **manager.counters(),
    }


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False, file=sys.stderr, mininterval=0.5)
