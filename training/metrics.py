"""report.json metrics: the predictor against its trivial baselines, on one split."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
from scipy.stats import pearsonr, spearmanr

from predictor.base import Calibration, Prediction
from predictor.calibration import cheapest_monotone, group_costs
from training.data import TrainStats, bucket_index


def _safe_corr(fn, a: np.ndarray, b: np.ndarray) -> float | None:
    if len(a) < 3 or np.all(a == a[0]) or np.all(b == b[0]):
        return None
    return round(float(fn(a, b)[0]), 4)


def evaluate(preds: Sequence[Prediction], realized: np.ndarray, calibration: Calibration, stats: TrainStats,
             s3_baseline_buckets: np.ndarray | None = None) -> dict:
    """Every metric of report.json; `realized` is capped at the large bound (what a server can generate)."""
    y = np.asarray(realized, dtype=np.float64)
    length = np.array([p.length for p in preds], dtype=np.float64)
    unc = np.array([p.uncertainty for p in preds], dtype=np.float64)
    manager = calibration.bucket_manager()
    reserved = np.array([manager.select(float(a), float(b)).bound for a, b in zip(length, unc)], dtype=np.float64)
    # the bucket of L̂ itself, without inflation, τ, ceiling or table
    plain = dataclasses.replace(calibration, alpha=0.0, tau=math.inf, ceiling=math.inf, table=None).bucket_manager()
    ours_bucket = np.array([plain.select(float(a)).index for a in length])
    ours_bucket = np.where(ours_bucket < 0, len(calibration.bounds), ours_bucket)  # LARGE sorts last
    true_bucket = bucket_index(y, calibration.bounds)
    true_s3 = bucket_index(y, stats.s3_bounds)
    constant = stats.constant_bound
    realized_total = max(y.sum(), 1.0)
    per_request = reserved / np.maximum(y, 1.0)
    report = {
        "n": int(len(y)),
        "bucket_accuracy": round(float(np.mean(ours_bucket == true_bucket)), 4),
        "majority_bucket_accuracy": round(float(np.mean(true_bucket == stats.majority_bucket)), 4),
        "n_buckets": len(calibration.bounds),
        "bucket_bounds": list(calibration.bounds),
        "s3_bucket_accuracy": round(float(np.mean(bucket_index(length, stats.s3_bounds) == true_s3)), 4),
        "majority_s3_bucket_accuracy": round(float(np.mean(true_s3 == stats.majority_s3_bucket)), 4),
        "baseline_s3_bucket_accuracy": (round(float(np.mean(s3_baseline_buckets == true_s3)), 4)
                                        if s3_baseline_buckets is not None else None),
        "s3_buckets": {"count": len(stats.s3_bounds), "width_tokens": round(stats.cap / len(stats.s3_bounds), 1),
                       "bounds": list(stats.s3_bounds)},
        "mae_tokens": round(float(np.mean(np.abs(length - y))), 2),
        "median_mae_tokens": round(float(np.mean(np.abs(stats.median_length - y))), 2),
        "spearman": _safe_corr(spearmanr, length, y),
        "pearson_log": _safe_corr(pearsonr, np.log1p(length), np.log1p(y)),
        "underprediction_rate": round(float(np.mean(y > reserved)), 4),
        "underprediction_target": calibration.target,
        # Tokens the allocator holds per token actually generated (what pool capacity pays for).
        "mean_overreservation": round(float(reserved.sum() / realized_total), 4),
        "mean_overreservation_per_request": round(float(np.mean(per_request)), 4),
        "constant_reservation_tokens": constant,
        "constant_underprediction_rate": round(float(np.mean(y > constant)), 4),
        "constant_mean_overreservation": round(float(len(y) * constant / realized_total), 4),
        "static_mean_overreservation": round(float(len(y) * calibration.large_bound / realized_total), 4),
        "large_bucket_share": round(float(np.mean(reserved >= calibration.large_bound)), 4),
        "mean_uncertainty": round(float(unc.mean()), 4) if len(unc) else None,
        "alpha": round(calibration.alpha, 4),
        "tau": None if math.isinf(calibration.tau) else round(calibration.tau, 4),
        "ceiling": None if math.isinf(calibration.ceiling) else int(calibration.ceiling),
        "reservation_table": None if calibration.table is None else calibration.table.to_json(),
        "large_bound": calibration.large_bound,
    }
    return report


MONOTONE_BOUND_MAX_REQUESTS = 6000  # the programme is O(n · target·n · distinct lengths): sample above this


def monotone_bound(length: np.ndarray, realized: np.ndarray, target: float, cap: int) -> dict:
    """The fewest tokens a reservation that never reserves less for a longer L̂ can hold while missing at most
    ⌊target·n⌋ of these requests, fitted to their own realized lengths (in sample, off the bucket grid, one group
    per distinct L̂). No reservation table, ceiling or bucket grid on top of this L̂ (nor α·u with a constant u)
    reserves less on this split at this miss rate: only a better predictor can. Splits larger than
    MONOTONE_BOUND_MAX_REQUESTS are sampled (seed 0; `n` says how many requests it was computed on)."""
    length, realized = np.asarray(length, dtype=np.float64), np.asarray(realized, dtype=np.float64)
    if len(length) > MONOTONE_BOUND_MAX_REQUESTS:
        keep = np.random.default_rng(0).choice(len(length), MONOTONE_BOUND_MAX_REQUESTS, replace=False)
        length, realized = length[keep], realized[keep]
    allowed = int(math.floor(target * len(realized)))
    values, group = np.unique(length, return_inverse=True)
    choices = np.append(np.unique(realized[realized < cap]), float(cap))
    cost, misses = group_costs(group, len(values), choices, realized)
    total, _ = cheapest_monotone(cost, misses, allowed, trace_back=False)
    return {"n": int(len(length)), "groups": int(len(values)), "misses_allowed": allowed,
            "mean_overreservation": round(float(total / max(realized.sum(), 1.0)), 4)}


def evaluate_records(records: Sequence, preds: Sequence[Prediction], realized: np.ndarray, calibration: Calibration,
                     stats: TrainStats, s3_baseline_buckets: np.ndarray | None = None) -> dict:
    """`evaluate`, plus the first/later-turn breakdown (`by_turn`) when the records are multi-turn."""
    report = evaluate(preds, realized, calibration, stats, s3_baseline_buckets)
    if calibration.target is not None and len(preds):  # once per report: by_turn's parts do not carry it
        report["monotone_bound"] = monotone_bound([p.length for p in preds], realized, calibration.target,
                                                  calibration.large_bound)
    if (turns := by_turn(records, preds, realized, calibration, stats)) is not None:
        report["by_turn"] = turns
    return report


def by_turn(records: Sequence, preds: Sequence[Prediction], realized: np.ndarray, calibration: Calibration,
            stats: TrainStats) -> dict | None:
    """The headline metrics for first turns and later turns apart, on a trace with multi-turn conversations:
    later turns carry their earlier replies' lengths, first turns only the prompt, and a pooled number would
    hide which of the two a predictor is good at. None for single-turn traces."""
    later = np.array([(getattr(r, "depth", None) or 0) > 0 for r in records], dtype=bool)
    if not later.any():
        return None
    keys = ("n", "spearman", "mae_tokens", "median_mae_tokens", "underprediction_rate", "mean_overreservation",
            "constant_mean_overreservation", "s3_bucket_accuracy", "majority_s3_bucket_accuracy")
    out = {}
    for name, mask in (("first_turns", ~later), ("later_turns", later)):
        if mask.any():
            part = evaluate([p for p, m in zip(preds, mask) if m], np.asarray(realized)[mask], calibration, stats)
            out[name] = {k: part[k] for k in keys}
    return out


def ranking_bound(cal_length: np.ndarray, cal_realized: np.ndarray, length: np.ndarray, realized: np.ndarray,
                  target: float, cap: int, groups: int = 10) -> dict:
    """A held-out yardstick for reserving by L̂ group: requests fall into `groups` by L̂ (edges from the
    calibration split), each group reserves its calibration split's (1 − target) quantile (split-conformal rank;
    the cap when a group is too small; small splits get fewer groups), off the bucket grid and without u. Not
    a bound: the calibrated reservation table can beat it by spending the misses unevenly across groups;
    `monotone_bound` is the bound."""
    cal_length, cal_realized = np.asarray(cal_length, float), np.asarray(cal_realized, float)
    length, realized = np.asarray(length, float), np.asarray(realized, float)
    # a group needs (1 − ε)/ε requests before its conformal quantile is below the cap: fewer, larger groups
    groups = max(1, min(groups, int(len(cal_length) * target / (1.0 - target))))
    edges = np.unique(np.quantile(cal_length, np.linspace(0, 1, groups + 1)[1:-1]))
    cal_group, group = np.searchsorted(edges, cal_length, side="right"), np.searchsorted(edges, length, side="right")
    reserve = np.full(len(edges) + 1, float(cap))
    for g in range(len(edges) + 1):
        ys = np.sort(cal_realized[cal_group == g])
        rank = math.ceil((len(ys) + 1) * (1.0 - target))
        if 0 < rank <= len(ys):
            reserve[g] = min(float(cap), ys[rank - 1])
    reserved = reserve[group]
    return {"groups": int(len(np.unique(cal_group))), "underprediction_rate": round(float(np.mean(realized > reserved)), 4),
            "mean_overreservation": round(float(reserved.sum() / max(realized.sum(), 1.0)), 4)}
