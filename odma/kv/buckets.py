"""Dynamic bucket manager: bucket bounds from quantiles of recently realized lengths (no torch).

The hot path (`select`, `observe`) is O(log K) / O(1) and reads an immutable bounds tuple that
`refresh` swaps in one assignment, so a background refresh never blocks or tears a reader.
In-flight requests keep the blocks they hold; only new reservations see new bounds.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from odma.config import BucketConfig, ReservationTable
from odma.errors import ConfigError, InvalidRequestError

LARGE = -1  # bucket index of the large bucket


@dataclass(frozen=True, slots=True)
class BucketChoice:
    index: int  # bucket index, or LARGE
    bound: int  # output tokens reserved

    @property
    def large(self) -> bool:
        return self.index == LARGE


def align_up(n: float, align: int) -> int:
    return max(align, int(math.ceil(n / align)) * align)


def equal_width_bounds(max_len: int, k: int) -> tuple[int, ...]:
    """S3-style static buckets: k equal-width ranges up to max_len."""
    if max_len < 1 or k < 1:
        raise ConfigError("equal_width_bounds needs max_len >= 1 and k >= 1")
    return tuple(sorted({max(1, math.ceil(max_len * (i + 1) / k)) for i in range(k)}))


def _clean(lengths: Sequence[int]) -> list[int]:
    out = sorted(int(x) for x in lengths)
    if not out:
        raise ConfigError("bucket bounds need at least one realized length")
    return out


def quantile_bounds(lengths: Sequence[int], k: int, align: int, cap: int | None = None) -> tuple[int, ...]:
    """Equal-occupancy bounds b_i = Q_{i/k}(L), aligned up, deduplicated (so possibly fewer than k)."""
    s = _clean(lengths)
    n = len(s)
    bounds: list[int] = []
    for i in range(1, k + 1):
        q = s[min(n - 1, math.ceil(i * n / k) - 1)]
        b = align_up(q, align)
        if cap is not None:
            b = min(b, cap)
        if not bounds or b > bounds[-1]:
            bounds.append(b)
    return tuple(bounds)


def optimal_bounds(
    lengths: Sequence[int], k: int, align: int, cap: int | None = None, max_candidates: int = 256
) -> tuple[int, ...]:
    """Bounds that minimise the expected reserved tokens Σ bound(L) with at most k buckets, assuming each
    length lands in the smallest bucket that holds it. Dynamic programming over aligned length values."""
    s = _clean(lengths)
    values = sorted({min(align_up(x, align), cap) if cap else align_up(x, align) for x in s})
    if len(values) > max_candidates:  # coarsen to quantile candidates, always keeping the maximum
        step = len(values) / max_candidates
        values = sorted({values[min(len(values) - 1, int(math.ceil((i + 1) * step)) - 1)] for i in range(max_candidates)})
    # counts[j]: lengths whose aligned value falls in (values[j-1], values[j]]
    counts = [0] * len(values)
    for x in s:
        v = min(align_up(x, align), cap) if cap else align_up(x, align)
        counts[bisect.bisect_left(values, v)] += 1
    m = len(values)
    cum = [0]
    for c in counts:
        cum.append(cum[-1] + c)
    k = min(k, m)  # splitting a bucket never costs more, so exactly k buckets is optimal
    # cost[j]: min reserved tokens covering values[0..j] with the last bucket's bound = values[j]
    cost = [cum[j + 1] * values[j] for j in range(m)]
    parents: list[list[int]] = []
    for _ in range(1, k):
        new = [math.inf] * m
        parent = [-1] * m
        for j in range(m):
            vj, cj = values[j], cum[j + 1]
            for i in range(j):
                c = cost[i] + (cj - cum[i + 1]) * vj
                if c < new[j]:
                    new[j], parent[j] = c, i
        cost = new
        parents.append(parent)
    bounds = [values[m - 1]]  # the top bucket must hold the longest length
    j = m - 1
    for parent in reversed(parents):
        j = parent[j]
        bounds.append(values[j])
    return tuple(sorted(bounds))


def default_bounds(config: BucketConfig) -> tuple[int, ...]:
    """Geometric bounds from 64 tokens up to the large bound, used until enough lengths are seen."""
    k = config.max_buckets
    lo, hi = min(64, config.large_bound), config.large_bound
    raw = [lo * (hi / lo) ** (i / max(1, k - 1)) for i in range(k)] if k > 1 else [hi]
    return tuple(sorted({min(hi, align_up(x, config.align)) for x in raw}))


class BucketManager:
    """Bucket bounds derived from a sliding window of realized lengths."""

    def __init__(self, config: BucketConfig | None = None, bootstrap: Sequence[int] | None = None) -> None:
        self.config = config or BucketConfig()
        self.alpha = self.config.alpha
        self.tau = self.config.tau
        self.ceiling = self.config.ceiling
        self.table = self.config.table
        self._window: deque[int] = deque(maxlen=self.config.window)
        self._lock = threading.Lock()
        self._since_refresh = 0
        self._last_refresh = time.monotonic()
        self._dynamic = True
        self._follower = False  # bounds come from elsewhere (install), e.g. a cluster's shared window
        self._large_choice = BucketChoice(LARGE, self.config.large_bound)
        self._bounds = default_bounds(self.config)
        self.version = 0
        self.refreshes = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        if bootstrap:
            self._window.extend(int(x) for x in bootstrap)
            self.refresh()

    @classmethod
    def fixed(
        cls, bounds: Sequence[int], large_bound: int, alpha: float = 0.0, tau: float = math.inf,
        ceiling: float = math.inf, table: ReservationTable | None = None,
    ) -> "BucketManager":
        """Static bounds that never refresh (the S3 baseline, or bounds chosen offline)."""
        bounds = tuple(sorted({int(b) for b in bounds}))
        if not bounds or bounds[0] < 1:
            raise ConfigError(f"fixed bucket bounds must be positive, got {bounds}")
        config = BucketConfig(
            max_buckets=len(bounds), align=1, large_bound=max(large_bound, bounds[-1]), alpha=alpha, tau=tau,
            ceiling=ceiling, table=table,
        )
        mgr = cls(config)
        mgr._bounds = bounds
        mgr._dynamic = False
        return mgr

    # -- hot path --------------------------------------------------------------------------------

    @property
    def bounds(self) -> tuple[int, ...]:
        return self._state[0]

    @property
    def _bounds(self) -> tuple[int, ...]:
        return self._state[0]

    @_bounds.setter
    def _bounds(self, bounds: tuple[int, ...]) -> None:
        self._state = (bounds, tuple(BucketChoice(i, b) for i, b in enumerate(bounds)))

    @property
    def large_bound(self) -> int:
        return self.config.large_bound

    def select(self, predicted: float, uncertainty: float = 0.0) -> BucketChoice:
        """Smallest bucket with bound >= L̂·(1 + α·u), but none above the bucket that holds the ceiling, or,
        with a reservation table, >= the table's tokens for L̂; u > τ, or nothing large enough: the large bucket."""
        if not math.isfinite(predicted) or predicted < 0:
            raise InvalidRequestError(f"predicted length must be a finite number >= 0, got {predicted}")
        if not math.isfinite(uncertainty) or uncertainty < 0:
            raise InvalidRequestError(f"uncertainty must be a finite number >= 0, got {uncertainty}")
        if uncertainty > self.tau:
            return self._large_choice
        if self.table is not None:
            return self._first_at_least(self.table.lookup(predicted))
        return self._first_at_least(min(predicted * (1.0 + self.alpha * uncertainty), self.ceiling))

    def next_above(self, needed: int) -> BucketChoice:
        """The smallest bucket that holds `needed` output tokens (the growth target of a migration)."""
        return self._first_at_least(needed)

    def _first_at_least(self, target: float) -> BucketChoice:
        bounds, choices = self._state  # one read: a concurrent refresh swaps both at once
        i = bisect.bisect_left(bounds, target)
        if i == len(bounds):
            return self._large_choice
        return choices[i]  # prebuilt: no allocation on the hot path

    def observe(self, realized_len: int) -> None:
        with self._lock:
            self._window.append(realized_len)
            self._since_refresh += 1

    # -- refresh (off the hot path) --------------------------------------------------------------

    def refresh_due(self) -> bool:
        if not self._dynamic or self._follower or len(self._window) < self.config.min_samples:
            return False
        return (
            self._since_refresh >= self.config.refresh_every_n
            or time.monotonic() - self._last_refresh >= self.config.refresh_every_s
        )

    def refresh(self) -> bool:
        """Recompute bounds from the window; True if they changed."""
        if not self._dynamic:
            return False
        with self._lock:
            snapshot = list(self._window)
            self._since_refresh = 0
            self._last_refresh = time.monotonic()
        if len(snapshot) < self.config.min_samples:
            return False
        new = self.compute_bounds(snapshot)
        self.refreshes += 1
        if new == self._bounds:
            return False
        self._bounds = new
        self.version += 1
        return True

    def follow(self) -> None:
        """From now on the bounds are computed elsewhere and handed in with `install` (several engines that share
        one window of realized lengths); this manager still observes, but never refreshes from its own window."""
        self._follower = True

    def install(self, bounds: Sequence[int]) -> bool:
        """Adopt bounds computed elsewhere (sorted, positive, at most the large bound); True if they changed.
        Like a refresh: one swap, readers never block, in-flight requests keep their blocks."""
        new = tuple(int(b) for b in bounds)
        if not new or list(new) != sorted(set(new)) or new[0] < 1 or new[-1] > self.config.large_bound:
            raise ConfigError(f"bucket bounds must be increasing positive integers up to {self.config.large_bound}, "
                              f"got {list(bounds)}")
        if new == self._bounds:
            return False
        self._bounds = new
        self.version += 1
        return True

    def compute_bounds(self, lengths: Sequence[int]) -> tuple[int, ...]:
        c = self.config
        method = optimal_bounds if c.method == "optimal" else quantile_bounds
        return method(lengths, c.max_buckets, c.align, cap=c.large_bound)

    def window_lengths(self) -> list[int]:
        with self._lock:
            return list(self._window)

    def start(self, poll_s: float = 0.5) -> None:
        """Refresh in a background thread whenever a refresh is due."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(poll_s):
                if self.refresh_due():
                    self.refresh()

        self._thread = threading.Thread(target=loop, name="odma-bucket-refresh", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
