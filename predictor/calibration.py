"""Choose α (inflation), τ (large-bucket threshold) and the reservation ceiling on a held-out split so that
the under-prediction rate (realized length > reserved bound) meets a target — split conformal prediction over
the bucket grid.

For a fixed τ and ceiling each calibration request has a score: the smallest α at which the bucket manager's
choice covers it (inf when its length is above the ceiling's bucket). Taking the ⌈(n+1)(1−ε)⌉-th smallest
score as α gives, for exchangeable data, a miss rate of at most ε on new requests. τ and the ceiling are then
picked from small grids to minimise the tokens reserved on the same split (a mild selection effect; the test
split reports the rate actually achieved).

Or a reservation table: requests fall into up to 10 groups by L̂ (edges at quantiles of the split's L̂), and
each group reserves one bucket, chosen by dynamic programming to minimise the reserved tokens while missing at
most as many requests as the conformal rank allows (non-decreasing in L̂, so that a longer prediction never
reserves less). It is fitted on the split it is scored on, so it carries no conformal guarantee; the test
split reports its rate. `calibrate` keeps whichever of the two reserves fewer tokens on the split.

Why a ceiling: with a weak L̂ one α must lift the requests predicted short far enough to cover their long
tail, and then sends every request predicted long to the large bucket. With the ceiling at the bucket that
holds the (1 − ε) quantile no request reserves more than that bucket, so that candidate (and therefore the
chosen point) reserves no more on the calibration split than giving everyone that bucket, while L̂ still
picks smaller buckets for the requests it ranks short.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from odma.config import ReservationTable
from odma.errors import ConfigError

ALPHA_MARGIN = 1e-6  # select() needs L̂(1+αu) strictly above the bound below the realized length


@dataclass(frozen=True, slots=True)
class OperatingPoint:
    alpha: float
    tau: float
    ceiling: float  # math.inf: none
    underprediction_rate: float  # on the calibration split
    overreservation: float  # reserved tokens / realized tokens on the calibration split
    table: ReservationTable | None = None  # when set, it replaces α and the ceiling


def allowed_misses(n: int, target: float) -> int:
    """How many of n calibration requests may be missed: n minus the conformal rank ⌈(n+1)(1−ε)⌉ (< 0: the
    split is too small for the target)."""
    return n - math.ceil((n + 1) * (1.0 - target))


def reserved_bounds(pred: np.ndarray, unc: np.ndarray, bounds: tuple[int, ...], large_bound: int,
                    alpha: float, tau: float, ceiling: float = math.inf,
                    table: ReservationTable | None = None) -> np.ndarray:
    """Vectorised `BucketManager.select(L̂, u).bound` (tests pin the two to agree)."""
    b = np.asarray(bounds, dtype=np.float64)
    if table is not None:
        tokens = np.asarray(table.tokens, dtype=np.float64)
        target = tokens[np.searchsorted(np.asarray(table.edges, dtype=np.float64), pred, side="right")]
    else:
        target = np.minimum(pred * (1.0 + alpha * unc), ceiling)
    idx = np.searchsorted(b, target, side="left")
    out = np.where(idx < len(b), b[np.minimum(idx, len(b) - 1)], large_bound)
    return np.where(unc > tau, large_bound, out).astype(np.int64)


def coverage_scores(pred: np.ndarray, unc: np.ndarray, realized: np.ndarray, bounds: tuple[int, ...],
                    tau: float, ceiling: float = math.inf) -> np.ndarray:
    """Per request, the smallest α whose reservation holds the realized length (inf: no α does)."""
    b = np.asarray(bounds, dtype=np.float64)
    # The reservation covers y iff the inflated prediction exceeds the largest bound below y.
    below = np.searchsorted(b, realized, side="left") - 1
    floor = np.where(below >= 0, b[np.maximum(below, 0)], -np.inf)
    pred = np.maximum(pred, 1e-9)
    with np.errstate(divide="ignore", invalid="ignore"):
        needed = (floor / pred - 1.0) / unc
    score = np.where(pred > floor, 0.0, np.where(unc > 0, needed * (1 + ALPHA_MARGIN) + ALPHA_MARGIN, np.inf))
    score = np.where(floor >= ceiling, np.inf, score)  # no inflation lifts a reservation past the ceiling
    return np.where(unc > tau, 0.0, score)  # the large bucket holds every (capped) length


def conformal_alpha(scores: np.ndarray, target: float) -> float:
    """The ⌈(n+1)(1−ε)⌉-th smallest score; inf when the split is too small for the target."""
    n, misses = len(scores), allowed_misses(len(scores), target)
    if misses < 0:
        return math.inf
    return float(np.sort(scores)[n - misses - 1])


def reservation_table(pred: np.ndarray, realized: np.ndarray, bounds: tuple[int, ...], large_bound: int,
                      target: float, groups: int = 10) -> ReservationTable | None:
    """Per L̂ group the bucket that minimises Σ reserved tokens with at most `allowed_misses` misses overall,
    non-decreasing with L̂. None when the split is too small for the target or has fewer than two groups."""
    pred, realized = np.asarray(pred, dtype=np.float64), np.asarray(realized, dtype=np.float64)
    budget = allowed_misses(len(pred), target)
    edges = np.unique(np.quantile(pred, np.linspace(0, 1, groups + 1)[1:-1])) if len(pred) and groups > 1 else []
    if budget < 0 or len(edges) == 0:
        return None
    choices = np.array(sorted({b for b in bounds if b < large_bound}) + [large_bound], dtype=np.float64)
    group = np.searchsorted(edges, pred, side="right")
    cost, misses = group_costs(group, len(edges) + 1, choices, realized)
    _, picked = cheapest_monotone(cost, misses, budget)
    if picked is None:
        return None
    return ReservationTable(tuple(float(e) for e in edges), tuple(int(choices[j]) for j in picked))


def group_costs(group: np.ndarray, n_groups: int, choices: np.ndarray, realized: np.ndarray):
    """cost[g, j]: tokens group g reserves at choices[j]; misses[g, j]: its requests longer than choices[j]."""
    cost = np.bincount(group, minlength=n_groups)[:, None] * choices[None, :]
    above = np.zeros((n_groups, len(choices) + 1), dtype=np.int64)  # a request is missed by every choice below it
    np.add.at(above, (group, np.searchsorted(choices, realized, side="left")), 1)
    return cost, np.cumsum(above[:, ::-1], axis=1)[:, ::-1][:, 1:]


def cheapest_monotone(cost: np.ndarray, misses: np.ndarray, budget: int,
                      trace_back: bool = True) -> tuple[float, list[int] | None]:
    """One choice per group, non-decreasing from group to group, minimising Σ cost with Σ misses <= budget:
    dynamic programming over groups × misses used × last choice. Returns the cost (inf: infeasible) and, with
    `trace_back`, the choice per group."""
    n_groups, k = cost.shape
    columns, misses_used = np.arange(k), np.arange(budget + 1)[:, None]
    # best[m, j]: fewest tokens for the groups so far with m misses, the last group taking choice j
    best = np.full((budget + 1, k), np.inf)
    first = misses[0] <= budget
    best[misses[0][first], columns[first]] = cost[0][first]
    parents = []
    for g in range(1, n_groups):
        # the cheapest predecessor with a choice no larger than j, for every miss count
        prefix_min = np.minimum.accumulate(best, axis=1)
        left = misses_used - misses[g][None, :]  # misses left for the groups before
        before = np.maximum(left, 0)
        if trace_back:
            prefix_arg = np.maximum.accumulate(np.where(best == prefix_min, columns, 0), axis=1)
            parents.append(np.stack([before, prefix_arg[before, columns]], axis=-1))
        best = np.where(left >= 0, prefix_min[before, columns], np.inf) + cost[g]
    m, j = np.unravel_index(int(np.argmin(best)), best.shape)
    total = float(best[m, j])
    if not math.isfinite(total) or not trace_back:
        return total, None
    picked = [int(j)]
    for parent in reversed(parents):
        m, j = parent[m, j]
        picked.append(int(j))
    return total, picked[::-1]


def calibrate(pred: np.ndarray, unc: np.ndarray, realized: np.ndarray, bounds: tuple[int, ...],
              large_bound: int, target: float = 0.02, tau_grid: int = 24, table_groups: int = 10) -> OperatingPoint:
    """The (α, τ, ceiling), or the reservation table over `table_groups` L̂ groups (0: none), meeting `target`
    that reserves the fewest tokens on this split.

    `realized` must already be capped at `large_bound` (a server never generates past max_new_tokens)."""
    if not 0.0 < target < 1.0:
        raise ConfigError(f"under-prediction target must be in (0, 1), got {target}")
    pred, unc, realized = (np.asarray(a, dtype=np.float64) for a in (pred, unc, realized))
    if len(pred) == 0:
        raise ConfigError("calibration needs at least one request")
    taus = [math.inf] + sorted({float(q) for q in np.quantile(unc, np.linspace(0.5, 0.995, tau_grid))}, reverse=True)
    ceilings = [math.inf] + [float(b) for b in sorted(set(bounds)) if b < large_bound]
    best: OperatingPoint | None = None
    total = max(realized.sum(), 1.0)
    for ceiling in ceilings:
        for tau in taus:
            alpha = conformal_alpha(coverage_scores(pred, unc, realized, bounds, tau, ceiling), target)
            if not math.isfinite(alpha):
                continue
            reserved = reserved_bounds(pred, unc, bounds, large_bound, alpha, tau, ceiling)
            point = OperatingPoint(alpha, tau, ceiling, float(np.mean(realized > reserved)),
                                   float(reserved.sum() / total))
            if best is None or point.overreservation < best.overreservation:
                best = point
    table = reservation_table(pred, realized, bounds, large_bound, target, table_groups)  # None for < 2 groups
    if table is not None:
        reserved = reserved_bounds(pred, unc, bounds, large_bound, 0.0, math.inf, table=table)
        point = OperatingPoint(0.0, math.inf, math.inf, float(np.mean(realized > reserved)),
                               float(reserved.sum() / total), table)
        if best is None or point.overreservation < best.overreservation:
            best = point
    if best is None:  # nothing but "everything large" meets the target
        return OperatingPoint(0.0, 0.0, math.inf, float(np.mean(realized > large_bound)),
                              float(len(pred) * large_bound / total))
    return best
