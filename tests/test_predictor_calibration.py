"""Calibration meets its under-prediction target where the truth is known, and matches the allocator."""

import math

import numpy as np
import pytest

from odma.kv import BucketManager, quantile_bounds
from odma.errors import ConfigError
from odma.config import ReservationTable
from predictor.calibration import (allowed_misses, calibrate, conformal_alpha, coverage_scores, reservation_table,
                                   reserved_bounds)

CAP = 2048


def synthetic(n: int, seed: int):
    """Realized length = predicted median · lognormal noise whose spread the uncertainty reports."""
    rng = np.random.default_rng(seed)
    pred = np.exp(rng.uniform(2.0, 6.0, n))
    unc = rng.uniform(0.05, 1.0, n)
    realized = np.minimum(np.ceil(pred * np.exp(rng.normal(0.0, 0.8 * unc))), CAP)
    return pred, unc, realized


@pytest.fixture(scope="module")
def bounds():
    _, _, realized = synthetic(4000, 99)
    return quantile_bounds(realized.astype(int).tolist(), 8, 16, cap=CAP)


def reserve(point, pred, unc, bounds):
    return reserved_bounds(pred, unc, bounds, CAP, point.alpha, point.tau, point.ceiling, point.table)


@pytest.mark.parametrize("table_groups", [0, 10])
@pytest.mark.parametrize("target", [0.02, 0.05, 0.10])
def test_calibrated_rate_meets_target_on_fresh_data(bounds, target, table_groups):
    point = calibrate(*synthetic(3000, 1), bounds, CAP, target=target, table_groups=table_groups)
    assert point.underprediction_rate <= target
    if table_groups == 0:
        assert point.table is None
    pred, unc, realized = synthetic(20000, 2)  # same distribution, new draws
    rate = float(np.mean(realized > reserve(point, pred, unc, bounds)))
    assert abs(rate - target) < 0.012, rate  # near the target, not far below it


def test_tighter_target_reserves_more(bounds):
    loose = calibrate(*synthetic(3000, 3), bounds, CAP, target=0.10)
    tight = calibrate(*synthetic(3000, 3), bounds, CAP, target=0.01)
    assert tight.overreservation > loose.overreservation


def test_vectorised_reservation_is_what_the_bucket_manager_selects(bounds):
    pred, unc, _ = synthetic(500, 4)
    table = ReservationTable((20.0, 60.0, float(pred[0])), (bounds[0], bounds[3], 500, CAP))
    for alpha, tau, ceiling, tab in [(0.0, math.inf, math.inf, None), (1.7, 0.6, math.inf, None),
                                     (5.0, 0.9, 300.0, None), (3.0, math.inf, float(bounds[2]), None),
                                     (0.0, math.inf, math.inf, table), (0.0, 0.7, math.inf, table)]:
        manager = BucketManager.fixed(bounds, CAP, alpha=alpha, tau=tau, ceiling=ceiling, table=tab)
        expected = [manager.select(float(p), float(u)).bound for p, u in zip(pred, unc)]
        assert reserved_bounds(pred, unc, bounds, CAP, alpha, tau, ceiling, tab).tolist() == expected


def test_coverage_score_is_the_smallest_covering_alpha(bounds):
    pred, unc, realized = synthetic(300, 5)
    scores = coverage_scores(pred, unc, realized, bounds, math.inf)
    for p, u, y, s in zip(pred, unc, realized, scores):
        assert math.isfinite(s)
        manager = BucketManager.fixed(bounds, CAP, alpha=s)
        assert manager.select(float(p), float(u)).bound >= y
        if s > 1e-3:  # a little less inflation no longer covers it
            assert BucketManager.fixed(bounds, CAP, alpha=s * 0.99).select(float(p), float(u)).bound < y


def test_no_alpha_covers_a_length_above_the_ceilings_bucket(bounds):
    pred, unc, realized = synthetic(300, 7)
    ceiling = float(bounds[3])
    scores = coverage_scores(pred, unc, realized, bounds, math.inf, ceiling)
    assert np.all(np.isinf(scores[realized > ceiling]))
    assert np.all(np.isfinite(scores[realized <= bounds[3]]))


def weak(n: int, seed: int):
    """A predictor that knows nothing: L̂ and the realized length are independent, u is uninformative."""
    rng = np.random.default_rng(seed)
    realized = np.minimum(np.ceil(np.exp(rng.normal(5.0, 1.0, n))), CAP)
    return np.exp(rng.normal(5.0, 1.0, n)), rng.uniform(0.6, 0.9, n), realized


def test_a_weak_predictor_reserves_no_more_than_one_constant(bounds):
    """Without the ceiling one α must lift the shortest predictions over the long tail and sends every long
    prediction to the large bucket; with it the constant bucket is among the candidates."""
    pred, unc, realized = weak(3000, 8)
    point = calibrate(pred, unc, realized, bounds, CAP, target=0.05)
    grid = np.array(list(bounds) + [CAP], dtype=float)
    ordered = np.sort(realized)
    constant = grid[np.searchsorted(grid, ordered[math.ceil(3001 * 0.95) - 1])]  # conformal constant bucket
    assert point.underprediction_rate <= 0.05
    assert point.overreservation <= constant * len(realized) / realized.sum() + 1e-9
    assert math.isfinite(point.ceiling) or point.table is not None
    pred, unc, realized = weak(20000, 9)  # fresh draws: the rate holds, and the cost stays at the constant's
    reserved = reserve(point, pred, unc, bounds)
    assert abs(float(np.mean(realized > reserved)) - 0.05) < 0.015
    assert reserved.sum() <= constant * len(realized) * 1.02


def test_reservation_table_is_the_cheapest_monotone_table_within_the_miss_budget():
    """Brute force over every non-decreasing assignment of buckets to 4 L̂ groups."""
    import itertools

    rng = np.random.default_rng(11)
    grid = (50, 100, 200, 400)
    pred = rng.uniform(1, 100, 240)
    realized = np.minimum(np.ceil(pred * rng.uniform(0.5, 6.0, 240)), 800)
    table = reservation_table(pred, realized, grid, 800, target=0.05, groups=4)
    edges = np.array(table.edges)
    group = np.searchsorted(edges, pred, side="right")
    budget = allowed_misses(240, 0.05)
    choices = list(grid) + [800]
    best = math.inf
    for combo in itertools.combinations_with_replacement(choices, len(edges) + 1):  # sorted: non-decreasing
        reserved = np.array(combo)[group]
        if np.sum(realized > reserved) <= budget:
            best = min(best, reserved.sum())
    reserved = np.array(table.tokens)[group]
    assert list(table.tokens) == sorted(table.tokens)
    assert np.sum(realized > reserved) <= budget
    assert reserved.sum() == best


def test_reservation_table_needs_a_big_enough_split(bounds):
    pred, _, realized = synthetic(30, 12)
    assert reservation_table(pred, realized, bounds, CAP, target=0.02) is None  # 30 requests cannot show 2 %
    assert reservation_table(pred, realized, bounds, CAP, target=0.2, groups=1) is None
    assert calibrate(pred, np.zeros(30), realized, bounds, CAP, target=0.02).table is None


def test_conformal_alpha_needs_enough_samples():
    assert conformal_alpha(np.arange(10.0), 0.02) == math.inf
    assert conformal_alpha(np.arange(100.0), 0.05) == 95.0  # rank ⌈101 · 0.95⌉ = 96


def test_bad_target_is_a_config_error(bounds):
    with pytest.raises(ConfigError):
        calibrate(*synthetic(10, 6), bounds, CAP, target=0.0)
