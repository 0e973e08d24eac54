"""Batch-1 latency and batched throughput of any predictor, on real requests."""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from predictor.base import Predictor


def measure(predictor: Predictor, requests: Sequence[Any], n_single: int = 200, batch: int = 64,
            max_batched: int = 1024, warmup: int = 10) -> dict:
    """p50/p90 of one-request calls (tokenization included), and requests/s when called in batches."""
    if not requests:
        return {"p50_ms_batch1": None, "p90_ms_batch1": None, "throughput_rps": None}
    singles = [requests[i % len(requests)] for i in range(n_single)]
    for r in singles[:warmup]:
        predictor.predict([r])
    times = []
    for r in singles:
        t0 = time.perf_counter()
        predictor.predict([r])
        times.append(time.perf_counter() - t0)
    pool = list(requests[:max_batched])
    t0 = time.perf_counter()
    for s in range(0, len(pool), batch):
        predictor.predict(pool[s : s + batch])
    elapsed = time.perf_counter() - t0
    return {
        "p50_ms_batch1": round(1000 * float(np.median(times)), 3),
        "p90_ms_batch1": round(1000 * float(np.percentile(times, 90)), 3),
        "throughput_rps": round(len(pool) / elapsed, 1),
        "batch_size": batch,
        "n_single": n_single,
        "n_batched": len(pool),
    }
