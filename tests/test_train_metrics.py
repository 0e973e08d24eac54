"""Report metrics on cases whose answers are known by hand."""

import math

import numpy as np

from predictor.base import Calibration, Prediction
from training.data import TrainStats, bucket_index
from training.metrics import by_turn, evaluate

BOUNDS = (64, 128, 256, 512)


def stats():
    train = np.array([10, 20, 30, 100, 200, 300, 400, 500, 600, 1500])
    return TrainStats.from_lengths(train, cap=2048, target=0.1)


def test_oracle_is_perfect():
    y = np.array([5, 70, 200, 400, 900])
    cal = Calibration(BOUNDS, 2048, alpha=0.0, tau=math.inf, target=0.02)
    r = evaluate([Prediction(float(v), 0.0) for v in y], y, cal, stats())
    assert r["mae_tokens"] == 0 and r["bucket_accuracy"] == 1.0 and r["s3_bucket_accuracy"] == 1.0
    assert r["underprediction_rate"] == 0.0 and r["spearman"] == 1.0
    # reserved: 64, 128, 256, 512, 2048 (900 overflows every bucket: the large one)
    assert r["mean_overreservation"] == round((64 + 128 + 256 + 512 + 2048) / y.sum(), 4)


def test_underprediction_and_baselines():
    y = np.array([100, 100, 100, 100])
    cal = Calibration(BOUNDS, 2048, alpha=0.0, tau=math.inf, target=0.02)
    r = evaluate([Prediction(50.0, 0.5)] * 4, y, cal, stats())
    assert r["underprediction_rate"] == 1.0  # reserved 64 < 100
    assert r["mae_tokens"] == 50 and r["median_mae_tokens"] == abs(250 - 100)
    assert r["spearman"] is None  # constant predictions have no rank correlation


def test_alpha_and_tau_are_applied():
    y = np.array([100])
    lifted = evaluate([Prediction(50.0, 1.0)], y, Calibration(BOUNDS, 2048, alpha=2.0), stats())
    assert lifted["underprediction_rate"] == 0.0  # 50 · (1 + 2·1) = 150 → bucket 256
    large = evaluate([Prediction(50.0, 0.9)], y, Calibration(BOUNDS, 2048, tau=0.5), stats())
    assert large["large_bucket_share"] == 1.0


def test_bucket_index_and_stats():
    assert bucket_index([1, 64, 65, 600], BOUNDS).tolist() == [0, 0, 1, 4]
    s = stats()
    assert s.s3_bounds[0] == 205 and len(s.s3_bounds) == 10
    assert TrainStats.from_json(s.to_json()) == s


def test_ranking_bound_rewards_ranking_and_meets_its_target():
    from training.metrics import ranking_bound

    rng = np.random.default_rng(0)
    cal_y, test_y = (rng.lognormal(5, 1, 4000).round() + 1 for _ in range(2))
    perfect = ranking_bound(cal_y, cal_y, test_y, test_y, target=0.05, cap=100_000)
    blind = ranking_bound(np.ones(4000), cal_y, np.ones(4000), test_y, target=0.05, cap=100_000)
    assert blind["groups"] == 1  # one group: the constant (1 − target) quantile
    assert abs(blind["underprediction_rate"] - 0.05) < 0.015  # conformal: at most the target, here about it
    assert perfect["underprediction_rate"] < 0.05 + 0.015
    assert perfect["mean_overreservation"] < 0.6 * blind["mean_overreservation"]
    tiny = ranking_bound(cal_y[:10], cal_y[:10], test_y, test_y, target=0.02, cap=5000)
    assert tiny["mean_overreservation"] == round(len(test_y) * 5000 / test_y.sum(), 4)  # too few to calibrate


def test_monotone_bound_is_below_every_monotone_reservation(monkeypatch):
    from predictor.calibration import calibrate, reserved_bounds
    from training.metrics import monotone_bound

    rng = np.random.default_rng(1)
    y = np.minimum(rng.lognormal(5, 1, 1000).round() + 1, 2048)
    perfect = monotone_bound(y, y, 0.02, 2048)["mean_overreservation"]  # L̂ = the length: reserve about it
    assert 0.9 < perfect <= 1.0  # below 1: the 20 misses allowed reserve less than they generate
    blind = monotone_bound(np.ones(1000), y, 0.02, 2048)  # one group: the in-sample constant
    assert blind["groups"] == 1 and blind["misses_allowed"] == 20
    assert blind["mean_overreservation"] == round(float(np.sort(y)[-21] * 1000 / y.sum()), 4)
    noisy = y * rng.lognormal(0, 0.7, 1000)
    bound = monotone_bound(noisy, y, 0.02, 2048)["mean_overreservation"]
    assert 1.0 < bound < blind["mean_overreservation"]
    monkeypatch.setattr("training.metrics.MONOTONE_BOUND_MAX_REQUESTS", 500)  # a large split is sampled
    part = monotone_bound(noisy, y, 0.02, 2048)
    assert part["n"] == 500 and part["misses_allowed"] == 10
    grid = (64, 128, 256, 512, 1024)
    for groups in (2, 10, 50):  # even calibrated on these very requests, a table reserves no less
        point = calibrate(noisy, np.zeros(1000), y, grid, 2048, target=0.02, table_groups=groups)
        reserved = reserved_bounds(noisy, np.zeros(1000), grid, 2048, point.alpha, point.tau, point.ceiling,
                                   point.table)
        assert reserved.sum() / y.sum() >= bound


def test_by_turn_splits_first_and_later_turns():
    """A good prediction on later turns and a constant one on first turns: the pooled numbers would blur
    the two, the breakdown shows each; a single-turn trace gets no breakdown."""
    from types import SimpleNamespace

    y = np.array([30, 300, 90, 40, 400, 120])
    depths = [0, 0, 0, 1, 2, 1]
    records = [SimpleNamespace(depth=d) for d in depths]
    preds = [Prediction(100.0, 0.0)] * 3 + [Prediction(float(v), 0.0) for v in y[3:]]
    cal = Calibration(BOUNDS, 2048, alpha=0.0, tau=math.inf, target=0.02)
    turns = by_turn(records, preds, y, cal, stats())
    assert turns["first_turns"]["n"] == 3 and turns["later_turns"]["n"] == 3
    assert turns["later_turns"]["spearman"] == 1.0 and turns["later_turns"]["mae_tokens"] == 0
    assert turns["first_turns"]["spearman"] is None
    assert turns["first_turns"]["mae_tokens"] == round(np.mean(np.abs(100 - y[:3])), 2)
    assert by_turn([SimpleNamespace(depth=None)] * 6, preds, y, cal, stats()) is None
