"""eLLM's CPU KV buffer rules, one test per rule: θ admission without hold-and-wait (Algorithm 1) and
SLO-aware logical buffer scaling (Algorithm 2: window 5, 3 violations, factor α)."""

from __future__ import annotations

import pytest

from odma.errors import ConfigError, InvalidRequestError, UnknownRequestError
from odma.offload import OffloadConfig, OffloadController

GB = 1000


def ctl(**kw) -> OffloadController:
    return OffloadController(OffloadConfig(**{"capacity_bytes": 10 * GB, "alpha": 0.5, "theta": 0.9, **kw}))


# -- Algorithm 1 ---------------------------------------------------------------------------------------

def test_admits_when_usage_stays_under_theta():
    c = ctl()
    a = c.admit(need_bytes=2 * GB, device_used=7 * GB, device_total=10 * GB)
    assert a.admit and a.offload == ()
    assert not ctl().admit(2 * GB + 1, 7 * GB, 10 * GB).admit  # 9 GB + 1 byte > θ·10 GB


def test_offloads_waiting_kv_to_cover_the_whole_deficit():
    c = ctl()
    a = c.admit(4 * GB, 7 * GB, 10 * GB, offloadable=[("w1", GB), ("w2", 1 * GB), ("w3", 5 * GB)])
    assert a.admit and a.offload == ("w1", "w2")  # deficit 2 GB: the first two cover it, in the given order
    assert c.metrics.admissions_with_offload == 1


def test_no_hold_and_wait_nothing_offloaded_when_the_deficit_cannot_be_covered():
    c = ctl(initial_bytes=1 * GB)
    a = c.admit(4 * GB, 7 * GB, 10 * GB, offloadable=[("w1", GB), ("w2", GB)])
    assert not a.admit and a.offload == () and c.offloaded() == {}
    assert c.metrics.rejections == 1


def test_offload_candidates_respect_the_logical_buffer_and_skip_already_offloaded():
    c = ctl(initial_bytes=3 * GB)
    c.record_offload("w0", GB)
    a = c.admit(4 * GB, 7 * GB, 10 * GB, offloadable=[("w0", GB), ("big", 3 * GB), ("w1", GB), ("w2", GB)])
    assert a.admit and a.offload == ("w1", "w2")  # w0 is on the host already, big exceeds the 2 GB free


def test_record_offload_and_fetch_account_bytes():
    c = ctl(initial_bytes=2 * GB)
    c.record_offload("a", GB)
    with pytest.raises(InvalidRequestError):
        c.record_offload("b", GB + 1)
    with pytest.raises(InvalidRequestError):
        c.record_offload("a", 1)
    assert c.can_fetch("a", device_used=8 * GB, device_total=10 * GB)
    assert not c.can_fetch("a", device_used=8 * GB + 1, device_total=10 * GB)
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
    assert not c.admit(2 * GB, 8 * GB, 10 * GB, offloadable=[("b", GB)]).admit


@pytest.mark.parametrize("kw", [dict(alpha=0), dict(alpha=1), dict(window=5, violations=6), dict(theta=0),
                                dict(min_bytes=11 * GB), dict(initial_bytes=11 * GB)])
def test_bad_config(kw):
    with pytest.raises(ConfigError):
        OffloadConfig(**{"capacity_bytes": 10 * GB, **kw})
