"""Placement over several pools in one process: identical bucket bounds, balance, pressure, routing."""

from __future__ import annotations

import random

import pytest

from odma.buckets import BucketManager
from odma.cluster import ClusterManager
from odma.config import BucketConfig
from odma.errors import ConfigError, DuplicateRequestError, UnknownRequestError
from odma.policy import KVRequest


def cluster(devices="mlu:0,mlu:1", tokens=1024, **kw) -> ClusterManager:
    buckets = BucketManager(BucketConfig(max_buckets=3, align=16, min_samples=4, refresh_every_n=8, large_bound=256),
                            bootstrap=[20, 60, 120])
    return ClusterManager.from_device_list(devices, buckets, tokens, large_share=0.1, align=16, **kw)


def test_bucket_bounds_are_identical_across_devices_through_refreshes():
    c = cluster("mlu:0,mlu:1,mlu:2")
    rng = random.Random(0)
    for i in range(60):
        rid = f"r{i}"
        if c.place(KVRequest(rid, 16, 256, predicted_tokens=rng.uniform(1, 200))) is not None:
            c.release(rid, rng.randint(1, 256))
        c.buckets.refresh()
        bounds = set(c.bucket_bounds().values())
        assert len(bounds) == 1
    assert c.buckets.version > 0  # bounds did move, and moved everywhere at once


def test_equal_devices_share_the_load():
    c = cluster("mlu:0,mlu:1")
    for i in range(10):
        assert c.place(KVRequest(f"r{i}", 32, 64, predicted_tokens=30)) is not None
    counts = [l.live_blocks for l in c.loads()]
    assert counts == [5, 5]


def test_memory_pressure_steers_away_from_a_full_device():
    c = cluster("mlu:0,mlu:1", w_compute=0.0)
    big = KVRequest("big", 600, 64, predicted_tokens=30)
    first = c.place(big).device
    other = "mlu:1" if first == "mlu:0" else "mlu:0"
    for i in range(3):
        assert c.place(KVRequest(f"s{i}", 64, 64, predicted_tokens=30)).device == other


def test_refused_everywhere_then_routing_and_errors():
    c = cluster("cuda:0,cuda:1", tokens=512)  # blocks of 100 + 64 (bucket bound) = 176 tokens: two per device
    placed = [c.place(KVRequest(f"r{i}", 100, 64, predicted_tokens=20)) for i in range(6)]
    assert all(p is not None for p in placed[:4]) and placed[4] is None and placed[5] is None
    dev = c.device_of("r0")
    assert c.extend("r0", 130).offset >= 0 and c.device_of("r0") == dev
    c.release("r0", 30)
    with pytest.raises(UnknownRequestError):
        c.device_of("r0")
    with pytest.raises(DuplicateRequestError):
        c.place(KVRequest("r1", 10, 10, predicted_tokens=5))
    for p in c.pools.values():
        p.check_invariants()


def test_place_batch_puts_large_prompts_first():
    c = cluster("mlu:0,mlu:1", tokens=512)
    out = c.place_batch([KVRequest("s", 16, 16, predicted_tokens=8), KVRequest("l", 300, 16, predicted_tokens=8),
                         KVRequest("m", 200, 16, predicted_tokens=8)])
    assert all(out.values()) and out["l"].device != out["m"].device


def test_bad_cluster_configs():
    b = BucketManager.fixed((32,), 64)
    with pytest.raises(ConfigError):
        ClusterManager([], b, lambda d, p: None)
    with pytest.raises(ConfigError):
        ClusterManager(["mlu:0", "mlu:0"], b, lambda d, p: None)
