"""Choose α (inflation), τ (large-bucket threshold) and the reservation ceiling on a held-out split so that
the under-prediction rate (realized length > reserved bound) meets a target — split conformal prediction over
the bucket grid.

For a fixed τ and ceiling each calibration request has a score: the smallest α at which the bucket manager's
choice covers it (inf when its length is above the ceiling's bucket). Taking the ⌈(n+1)(1−ε)⌉-th smallest
score as α gives, for exchangeable data, a miss rate of at most ε on new requests. τ and the ceiling are then
picked from small grids to minimise the tokens reserved on the same split (a mild selection effect; the test
split reports the rate actually achieved).

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

from odma.errors import ConfigError

ALPHA_MARGIN = 1e-6  # select() needs L̂(1+αu) strictly above the bound below the realized length


@dataclass(frozen=True, slots=True)
class OperatingPoint:
    alpha: float
    tau: float
    ceiling: float  # math.inf: none
    underprediction_rate: float  # on the calibration split
    overreservation: float  # reserved tokens / realized tokens on the calibration split


def reserved_bounds(pred: np.ndarray, unc: np.ndarray, bounds: tuple[int, ...], large_bound: int,
                    alpha: float, tau: float, ceiling: float = math.inf) -> np.ndarray:
    """Vectorised `BucketManager.select(L̂, u).bound` (tests pin the two to agree)."""
    b = np.asarray(bounds, dtype=np.float64)
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
    n = len(scores)
    rank = math.ceil((n + 1) * (1.0 - target))
    if rank > n:
        return math.inf
    return float(np.sort(scores)[rank - 1])


def calibrate(pred: np.ndarray, unc: np.ndarray, realized: np.ndarray, bounds: tuple[int, ...],
              large_bound: int, target: float = 0.02, tau_grid: int = 24) -> OperatingPoint:
    """The (α, τ, ceiling) meeting `target` that reserves the fewest tokens on this split.

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
    if best is None:  # nothing but "everything large" meets the target
        return OperatingPoint(0.0, 0.0, math.inf, float(np.mean(realized > large_bound)),
                              float(len(pred) * large_bound / total))
    return best
