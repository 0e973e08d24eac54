"""Bucket bounds from realized lengths, selection, refresh."""

from __future__ import annotations

import bisect
import itertools
import math
import random
import time

import pytest

from odma.kv import BucketManager, LARGE, equal_width_bounds, optimal_bounds, quantile_bounds
from odma.config import BucketConfig, ReservationTable
from odma.errors import ConfigError, InvalidRequestError


def reserved(bounds, lengths):
    return sum(bounds[bisect.bisect_left(bounds, x)] for x in lengths)


def test_quantile_bounds_equalize_occupancy():
    lengths = list(range(1, 1001))
    bounds = quantile_bounds(lengths, 4, align=1)
    assert bounds == (250, 500, 750, 1000)
    occupancy = [sum(1 for x in lengths if (lo < x <= hi)) for lo, hi in zip((0,) + bounds, bounds)]
    assert occupancy == [250, 250, 250, 250]


def test_bounds_are_aligned_capped_and_deduplicated():
    bounds = quantile_bounds([5, 5, 5, 5, 300, 900], 6, align=16, cap=512)
    assert all(b % 16 == 0 for b in bounds[:-1]) and bounds[-1] == 512
    assert list(bounds) == sorted(set(bounds))


@pytest.mark.parametrize("seed", range(5))
def test_optimal_bounds_match_brute_force(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 120) for _ in range(60)]
    k = 3
    got = optimal_bounds(lengths, k, align=8)
    values = sorted({-(-x // 8) * 8 for x in lengths})
    best = min(
        reserved(tuple(sorted(c)) + (values[-1],), lengths)
        for c in itertools.combinations(values[:-1], k - 1)
    )
    assert reserved(got, lengths) == best
    assert len(got) <= k and got[-1] == values[-1]


def test_optimal_never_reserves_more_than_quantiles():
    rng = random.Random(7)
    lengths = [int(rng.lognormvariate(5, 1)) + 1 for _ in range(3000)]
    q = quantile_bounds(lengths, 8, 16, cap=4096)
    o = optimal_bounds(lengths, 8, 16, cap=4096)
    capped = [min(x, 4096) for x in lengths]
    assert reserved(o, capped) <= reserved(q, capped)


def test_equal_width():
    assert equal_width_bounds(512, 4) == (128, 256, 384, 512)


def test_select_picks_smallest_fitting_bucket_or_large():
    bm = BucketManager.fixed((100, 200, 400), large_bound=1000, alpha=0.5, tau=0.8)
    assert bm.select(100, 0.0).bound == 100
    assert bm.select(101, 0.0).bound == 200
    assert bm.select(100, 0.5).bound == 200  # 100 * 1.25
    assert bm.select(50, 0.9).index == LARGE  # too uncertain
    assert bm.select(401, 0.0) == bm.select(0, 0.81)  # nothing fits / too uncertain → large
    assert bm.select(401, 0.0).bound == 1000
    assert bm.next_above(201).bound == 400


def test_ceiling_caps_the_admission_bucket_but_not_the_uncertain_route():
    bm = BucketManager.fixed((100, 200, 400), large_bound=1000, alpha=1.0, tau=0.8, ceiling=150)
    assert bm.select(90, 0.0).bound == 100
    assert bm.select(90, 0.5).bound == 200  # 135 → 200: the bucket holding the ceiling is allowed
    assert bm.select(390, 0.5).bound == 200  # 585 would take the large bucket; the ceiling stops it at 200
    assert bm.select(390, 0.9).index == LARGE  # u > τ still routes to the large bucket
    assert bm.next_above(300).bound == 400  # growth is not capped: an outgrowing request migrates up
    assert BucketManager.fixed((100, 200), 1000, ceiling=250).select(900).index == LARGE  # nothing holds 250


def test_a_reservation_table_replaces_inflation_on_any_grid():
    table = ReservationTable((50.0, 300.0), (120, 200, 900))
    bm = BucketManager.fixed((100, 200, 400), large_bound=1000, tau=0.8, table=table)
    assert bm.select(10, 0.5).bound == 200  # 120 tokens → the first bucket holding them
    assert bm.select(50, 0.0).bound == 200  # an edge belongs to the group above it
    assert bm.select(299, 0.0).bound == 200
    assert bm.select(300, 0.0).index == LARGE  # 900 tokens: no bucket below the large one holds them
    assert bm.select(10, 0.9).index == LARGE  # u > τ still routes to the large bucket
    assert BucketManager.fixed((128, 256, 1024), 1000, table=table).select(10).bound == 128  # another grid


@pytest.mark.parametrize("edges,tokens", [((1.0,), (10,)), ((5.0, 5.0), (1, 2, 3)), ((float("nan"),), (1, 2)),
                                          ((1.0,), (0, 5))])
def test_bad_reservation_table(edges, tokens):
    with pytest.raises(ConfigError):
        ReservationTable(edges, tokens)


def test_a_table_with_inflation_is_ambiguous():
    table = ReservationTable((), (100,))
    with pytest.raises(ConfigError, match="replaces"):
        BucketConfig(alpha=1.0, table=table)
    with pytest.raises(ConfigError, match="replaces"):
        BucketConfig(ceiling=500, table=table)


@pytest.mark.parametrize("bad", [(-1, 0), (float("nan"), 0), (10, -0.1), (10, float("inf"))])
def test_select_rejects_bad_input(bad):
    with pytest.raises(InvalidRequestError):
        BucketManager.fixed((10,), 100).select(*bad)


def test_refresh_follows_the_window_and_bumps_version():
    cfg = BucketConfig(
        max_buckets=4, align=1, window=100, min_samples=10, refresh_every_n=50, large_bound=5000, method="quantile"
    )
    bm = BucketManager(cfg, bootstrap=list(range(1, 101)))
    assert bm.bounds == (25, 50, 75, 100) and bm.version == 1
    for x in range(1000, 1100):
        bm.observe(x)
    assert bm.refresh_due()
    assert bm.refresh() and bm.version == 2
    assert bm.bounds == (1024, 1049, 1074, 1099)  # the old lengths slid out of the window
    assert not bm.refresh_due()


def test_no_refresh_below_min_samples_and_default_bounds():
    cfg = BucketConfig(max_buckets=4, min_samples=50, large_bound=1024)
    bm = BucketManager(cfg)
    assert bm.bounds[-1] <= 1024 and len(bm.bounds) == 4
    bm.observe(10)
    assert not bm.refresh_due() and not bm.refresh()


def test_fixed_buckets_never_refresh():
    bm = BucketManager.fixed((10, 20), 100)
    for _ in range(1000):
        bm.observe(500)
    assert not bm.refresh() and bm.bounds == (10, 20)


def test_background_refresh_thread():
    cfg = BucketConfig(max_buckets=2, align=1, min_samples=4, refresh_every_n=4, large_bound=1000)
    bm = BucketManager(cfg)
    bm.start(poll_s=0.01)
    try:
        for x in (10, 10, 90, 90):
            bm.observe(x)
        deadline = time.monotonic() + 5
        while bm.version == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bm.bounds == (10, 90)
    finally:
        bm.stop()


@pytest.mark.parametrize("kw", [{"max_buckets": 0}, {"align": 0}, {"method": "median"}, {"alpha": -1}, {"tau": math.nan},
                                {"ceiling": 0}, {"ceiling": math.nan}])
def test_config_validation(kw):
    with pytest.raises(ConfigError):
        BucketConfig(**kw)
