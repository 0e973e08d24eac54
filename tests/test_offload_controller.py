"""eLLM's CPU KV buffer, one test per rule: byte accounting of offloads and fetches, and SLO-aware logical buffer
scaling (Algorithm 2: window 5, 3 violations, factor α). Algorithm 1's θ is the scheduler's (test_engine_scheduler)."""

from __future__ import annotations

import pytest

from odma.errors import ConfigError, InvalidRequestError, UnknownRequestError
from odma.kv import OffloadConfig, OffloadController

GB = 1000


def ctl(**kw) -> OffloadController:
    return OffloadController(OffloadConfig(**{"capacity_bytes": 10 * GB, "alpha": 0.5, **kw}))


def test_record_offload_and_fetch_account_bytes():
    c = ctl(initial_bytes=2 * GB)
    c.record_offload("a", GB)
    with pytest.raises(InvalidRequestError):
        c.record_offload("b", GB + 1)
    with pytest.raises(InvalidRequestError):
        c.record_offload("a", 1)
    assert c.record_fetch("a") == GB and c.used_bytes == 0
    assert (c.metrics.offloads, c.metrics.offloaded_bytes, c.metrics.fetches, c.metrics.fetched_bytes) == (1, GB, 1, GB)
    with pytest.raises(UnknownRequestError):
        c.record_fetch("a")


# -- Algorithm 2 ---------------------------------------------------------------------------------------

def test_three_tpot_violations_in_five_iterations_shrink_by_alpha():
    c = ctl(initial_bytes=8 * GB)
    for flag in (True, False, True, False):
        assert c.end_iteration(ttft_violated=False, tpot_violated=flag) == 8 * GB
    assert c.end_iteration(False, True) == 4 * GB  # 3rd violation within the window: size·(1-α)
    assert c.metrics.buffer_shrinks == 1 and c.metrics.buffer_size[-1] == (5, 4 * GB)


def test_three_ttft_violations_grow_by_alpha_up_to_capacity():
    c = ctl(initial_bytes=4 * GB)
    for _ in range(3):
        c.end_iteration(True, False)
    assert c.logical_bytes == 6 * GB
    for _ in range(6):
        c.end_iteration(True, False)
    assert c.logical_bytes == 10 * GB  # 9 GB, then capped at capacity
    assert c.metrics.buffer_grows == 3


def test_violations_older_than_the_window_do_not_count():
    c = ctl(initial_bytes=8 * GB)
    for flag in (True, True, False, False, False, False, True):
        c.end_iteration(False, flag)
    assert c.logical_bytes == 8 * GB  # never 3 violations inside 5 consecutive iterations


def test_window_restarts_after_a_scaling_step():
    c = ctl(initial_bytes=8 * GB)
    for _ in range(3):
        c.end_iteration(False, True)
    assert c.logical_bytes == 4 * GB
    c.end_iteration(False, True), c.end_iteration(False, True)
    assert c.logical_bytes == 4 * GB  # two fresh violations are not three
    c.end_iteration(False, True)
    assert c.logical_bytes == 2 * GB


def test_simultaneous_ttft_and_tpot_violations_cancel():
    c = ctl(initial_bytes=8 * GB)
    for _ in range(5):
        c.end_iteration(True, True)
    assert c.logical_bytes == 8 * GB


def test_shrink_respects_min_and_grow_starts_from_empty():
    c = ctl(initial_bytes=0, min_bytes=0)
    for _ in range(3):
        c.end_iteration(True, False)
    assert c.logical_bytes == 5 * GB  # α·capacity
    c2 = ctl(initial_bytes=4 * GB, min_bytes=3 * GB)
    for _ in range(3):
        c2.end_iteration(False, True)
    assert c2.logical_bytes == 3 * GB


def test_shrinking_below_use_stops_new_offloads_only():
    c = ctl(initial_bytes=4 * GB)
    c.record_offload("a", 3 * GB)
    for _ in range(3):
        c.end_iteration(False, True)
    assert c.logical_bytes == 2 * GB and c.offloaded() == {"a": 3 * GB} and c.free_bytes == 0
    with pytest.raises(InvalidRequestError):  # no new offload fits
        c.record_offload("b", GB)
    assert c.record_fetch("a") == 3 * GB and c.free_bytes == 2 * GB  # what is held comes back in full


@pytest.mark.parametrize("kw", [dict(alpha=0), dict(alpha=1), dict(window=5, violations=6),
                                dict(min_bytes=11 * GB), dict(initial_bytes=11 * GB)])
def test_bad_config(kw):
    with pytest.raises(ConfigError):
        OffloadConfig(**{"capacity_bytes": 10 * GB, **kw})
