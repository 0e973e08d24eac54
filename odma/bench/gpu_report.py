"""What every part of `odma-bench gpu` (odma/bench/gpu_bench.py) shares: the result being built and saved after
each measurement, a part's time cap, one measurement tried on its own, the device's backend and timing."""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from typing import Any, Callable


class Report:
    """The result being built: parts write into it and `save` rewrites the file after every measurement."""

    def __init__(self, result: dict, path: str | None) -> None:
        self.result, self.path = result, path

    def save(self) -> None:
        if self.path:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.result, f, indent=1)
            os.replace(tmp, self.path)


class Cap:
    """A part's time cap: `left()` before starting a measurement; what was not started is named in `skipped`."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.started = seconds, time.perf_counter()

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.started)


def attempt(out: dict, key: str, fn: Callable[[], Any], report: Report) -> Any:
    """out[key] = fn(), or the error it raised (one measurement's failure loses only its own number); saved."""
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON; the run goes on
        error = f"{type(exc).__name__}: {exc}"
        value = out.get(key)
        if isinstance(value, dict):  # a part that failed midway keeps what it had measured
            value["error"] = error
        else:
            value = {"error": error}
    out[key] = value
    report.save()
    return value


@functools.cache
def backend_of(device: str):
    """The backend of `device`, opened once for the run (it synchronizes, empties the cache, names the device)."""
    from backends import get_backend

    return get_backend(device)


def sync(device) -> None:
    backend_of(str(device)).synchronize()


def median_ms(fn, device, rounds: int, iters: int) -> float:
    """Median over rounds of the mean time of `iters` calls (after one warm-up call)."""
    fn()
    sync(device)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        times.append((time.perf_counter() - t0) / iters * 1e3)
    return statistics.median(times)


def copy_bandwidth(device, nbytes: int, rounds: int) -> float:
    """GB/s of one large device copy, bytes read + written (STREAM's copy)."""
    import torch

    a = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a), device, rounds, 3)
    return 2 * nbytes / ms / 1e6


def ints(spec: str | None, default: str) -> list[int]:
    return [int(x) for x in (spec or default).split(",") if x.strip()]
