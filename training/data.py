"""What training and evaluation agree on: the split, the length cap, the two bucket grids."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from odma.kv import BucketManager, align_up, equal_width_bounds
from odma.config import BucketConfig
from odma.errors import TraceError
from odma.traces import Trace, load_trace, split_trace

S3_BUCKETS = 10  # S3's static classifier: 10 equal-width buckets up to the length cap
DEFAULT_MAX_NEW_TOKENS = 2048


def load_for_training(spec: str, limit: int | None = None) -> Trace:
    trace = load_trace(spec, limit=limit)
    if not trace.records:
        raise TraceError(f"trace {spec!r} is empty")
    trace.require_lengths()
    if any(r.prompt is None for r in trace.records):
        raise TraceError(f"trace {spec!r} has requests without prompt text; a text predictor cannot train on it")
    return trace


def length_cap(trace: Trace, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> int:
    """The server never generates past max_new_tokens, so lengths are capped there (and at the trace's own cap)."""
    cap = trace.meta.get("length_cap")
    return min(max_new_tokens, int(cap)) if cap else max_new_tokens


def capped_lengths(trace: Trace, cap: int) -> np.ndarray:
    return np.minimum(np.asarray(trace.output_lengths(), dtype=np.int64), cap)


def dynamic_bounds(train_lengths: np.ndarray, cap: int, max_buckets: int = 8, align: int = 16) -> tuple[int, ...]:
    """The allocator's quantile buckets, as its BucketManager computes them from the training lengths."""
    config = BucketConfig(max_buckets=max_buckets, align=align, window=max(1, len(train_lengths)), large_bound=cap)
    return BucketManager(config, bootstrap=[int(x) for x in train_lengths]).bounds


@dataclass(frozen=True)
class TrainStats:
    """Training-split facts that the trivial baselines need, saved with the predictor for --eval-only."""

    cap: int
    median_length: float
    bounds: tuple[int, ...]  # dynamic quantile buckets
    s3_bounds: tuple[int, ...]  # equal-width buckets
    majority_bucket: int
    majority_s3_bucket: int
    constant_bound: int  # no predictor: everyone reserves the training (1 − target) quantile

    @classmethod
    def from_lengths(cls, lengths: np.ndarray, cap: int, target: float, align: int = 16) -> "TrainStats":
        bounds = dynamic_bounds(lengths, cap)
        s3 = equal_width_bounds(cap, S3_BUCKETS)
        ordered = np.sort(lengths)
        rank = min(len(ordered), math.ceil((len(ordered) + 1) * (1.0 - target)))
        constant = min(cap, align_up(int(ordered[rank - 1]), align))
        return cls(cap, float(np.median(lengths)), bounds, s3,
                   int(np.bincount(bucket_index(lengths, bounds)).argmax()),
                   int(np.bincount(bucket_index(lengths, s3)).argmax()), constant)

    def to_json(self) -> dict:
        d = asdict(self)
        d["bounds"], d["s3_bounds"] = list(self.bounds), list(self.s3_bounds)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "TrainStats":
        return cls(int(d["cap"]), float(d["median_length"]), tuple(d["bounds"]), tuple(d["s3_bounds"]),
                   int(d["majority_bucket"]), int(d["majority_s3_bucket"]), int(d["constant_bound"]))


def bucket_index(lengths, bounds: tuple[int, ...]) -> np.ndarray:
    """Index of the smallest bound >= length (len(bounds) when above them all)."""
    return np.searchsorted(np.asarray(bounds), np.asarray(lengths, dtype=np.float64), side="left")


def splits(trace: Trace):
    parts = split_trace(trace)
    for name, part in zip(("train", "val", "test"), parts):
        if not part.records:
            raise TraceError(f"trace {trace.name!r}: the {name} split is empty ({len(trace)} requests in all); "
                             "use a larger trace")
    return parts
