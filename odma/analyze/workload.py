"""A trace turned into the replay's requests: lengths clipped to the serving limits, arrivals assigned.

Nothing is dropped silently: requests that could never fit (prompt + max_new_tokens over the model
length) are counted as refused, outputs over max_new_tokens are clipped to it and counted, and so are
zero-length outputs raised to one token (the prefill always produces one).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from odma.errors import ConfigError
from odma.traces import Trace, TraceRecord, split_trace

ARRIVALS = ("offline", "trace", "poisson")


@dataclass(frozen=True, slots=True)
class WorkItem:
    request_id: str
    record: TraceRecord  # what the predictor reads (prompt, metadata; the realized length for oracles)
    prompt_tokens: int
    output_tokens: int  # realized, in [1, max_new_tokens]
    max_new_tokens: int
    arrival_s: float
    source_index: int  # which record of the replayed split it is a copy of (tiling repeats records)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    requests: int | None = None  # None: the trace as is; more than the trace: tile it (ids stay unique)
    arrivals: str = "offline"  # offline: all at t=0 | trace: the trace's timestamps | poisson: --rate
    rate: float | None = None  # requests per second for poisson
    max_new_tokens: int | None = None  # None: the trace's length cap if it has one, else 2048
    max_model_len: int = 16384  # prompt + max_new_tokens above this is refused
    split: str = "all"  # all | train | val | test (split_trace by prompt hash)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arrivals not in ARRIVALS:
            raise ConfigError(f"arrivals must be one of {ARRIVALS}, got {self.arrivals!r}")
        if self.arrivals == "poisson" and not (self.rate and self.rate > 0):
            raise ConfigError("poisson arrivals need --rate > 0 (requests per second)")
        if self.requests is not None and self.requests < 1:
            raise ConfigError(f"requests must be >= 1, got {self.requests}")
        if self.split not in ("all", "train", "val", "test"):
            raise ConfigError(f"split must be all, train, val or test, got {self.split!r}")


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    items: tuple[WorkItem, ...]  # admissible requests, in arrival order
    refused: int  # requests whose prompt + max_new_tokens exceeds max_model_len
    clipped_long: int  # outputs clipped to max_new_tokens
    raised_zero: int  # zero-length outputs counted as one token
    max_new_tokens: int
    bootstrap_lengths: tuple[int, ...]  # history for the dynamic buckets (the train split, or the trace)

    @property
    def arrivals(self) -> int:
        return len(self.items) + self.refused

    def summary(self) -> dict:
        outs = sorted(i.output_tokens for i in self.items)
        pct = (lambda q: outs[min(len(outs) - 1, int(q * len(outs)))]) if outs else (lambda q: 0)
        return {
            "name": self.name,
            "arrivals": self.arrivals,
            "admissible": len(self.items),
            "refused_too_large": self.refused,
            "clipped_to_max_new_tokens": self.clipped_long,
            "zero_outputs_raised_to_one": self.raised_zero,
            "max_new_tokens": self.max_new_tokens,
            "output_tokens_p50_p90_p99": [pct(0.5), pct(0.9), pct(0.99)],
            "mean_prompt_tokens": round(sum(i.prompt_tokens for i in self.items) / max(1, len(self.items)), 2),
            "mean_output_tokens": round(sum(outs) / max(1, len(outs)), 2),
            "span_s": self.items[-1].arrival_s if self.items else 0.0,
        }


def _select_split(trace: Trace, split: str) -> tuple[Trace, Trace]:
    """(the records to replay, the records whose lengths seed the buckets' history)."""
    if split == "all":
        return trace, trace
    parts = split_trace(trace)
    return getattr(parts, split), parts.train


def _tiled(records: list[TraceRecord], n: int) -> list[tuple[int, TraceRecord]]:
    """The first n records, cycling through the trace; copy k >= 1 gets ids 'id#k' and arrival + k·span."""
    if n <= len(records):
        return list(enumerate(records[:n]))
    span = max(r.arrival_s for r in records) + 1e-3
    out = []
    for i in range(n):
        k, r = divmod(i, len(records))
        rec = records[r]
        copy = dataclasses.replace(rec, request_id=f"{rec.request_id}#{k}", arrival_s=rec.arrival_s + k * span)
        out.append((r, rec if k == 0 else copy))
    return out


def build_workload(trace: Trace, spec: WorkloadSpec) -> Workload:
    trace.require_lengths()
    if not trace.records:
        raise ConfigError(f"trace {trace.name!r} has no requests")
    max_new = spec.max_new_tokens or int(trace.meta.get("length_cap") or 2048)
    if max_new < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new}")
    replayed, history = _select_split(trace, spec.split)
    if not replayed.records:
        raise ConfigError(f"split {spec.split!r} of trace {trace.name!r} is empty")
    tiled = _tiled(list(replayed.records), spec.requests or len(replayed.records))
    records = [rec for _, rec in tiled]
    rng = random.Random(spec.seed)
    if spec.arrivals == "poisson":
        t, times = 0.0, []
        for _ in records:
            t += rng.expovariate(spec.rate)  # type: ignore[arg-type]
            times.append(t)
    elif spec.arrivals == "trace":
        t0 = min(r.arrival_s for r in records)
        times = [r.arrival_s - t0 for r in records]
    else:
        times = [0.0] * len(records)
    items, refused, clipped, raised = [], 0, 0, 0
    for (source, rec), t in zip(tiled, times):
        if rec.prompt_tokens + max_new > spec.max_model_len or rec.prompt_tokens < 1:
            refused += 1
            continue
        out = rec.output_tokens or 0
        if out > max_new:
            clipped += 1
        if out < 1:
            raised += 1
        items.append(WorkItem(rec.request_id, rec, rec.prompt_tokens, min(max(out, 1), max_new), max_new, t, source))
    items.sort(key=lambda i: i.arrival_s)  # stable: equal times keep trace order
    history_lengths = [min(max(r.output_tokens or 1, 1), max_new) for r in history.records]
    rng.shuffle(history_lengths)
    return Workload(
        name=trace.name + ("" if spec.split == "all" else f":{spec.split}"),
        items=tuple(items),
        refused=refused,
        clipped_long=clipped,
        raised_zero=raised,
        max_new_tokens=max_new,
        bootstrap_lengths=tuple(history_lengths),
    )
