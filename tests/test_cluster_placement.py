"""Placement over several pools in one process (what the engine's `--devices` does): one policy and so one set
of bucket bounds everywhere, balance by load, memory pressure steering away from a full device."""

from __future__ import annotations

import random

from odma.config import BucketConfig
from odma.kv import BucketManager, BucketPolicy, ContiguousKV, KVPool, KVRequest, rank_devices


def pools(n: int, tokens: int = 1024) -> tuple[BucketPolicy, dict[str, ContiguousKV]]:
    buckets = BucketManager(BucketConfig(max_buckets=3, align=16, min_samples=4, refresh_every_n=8, large_bound=256),
                            bootstrap=[20, 60, 120])
    policy = BucketPolicy(buckets)  # one policy object for every device, as the engine builds it
    return policy, {f"mlu:{i}": ContiguousKV(KVPool(tokens, policy, large_share=0.1, align=16)) for i in range(n)}


def place(kvs: dict[str, ContiguousKV], req: KVRequest, **weights) -> str | None:
    """Reserve on the best-ranked device that has room now (the engine's score); None when none has."""
    need = next(iter(kvs.values())).initial_tokens(req)
    for device in rank_devices([kv.load(d) for d, kv in kvs.items()], need, **weights):
        if kvs[device].admit(req) is not None:
            return device
    return None


def test_bucket_bounds_are_identical_across_devices_through_refreshes():
    policy, kvs = pools(3)
    rng = random.Random(0)
    where: dict[str, str] = {}
    live: list[str] = []
    for i in range(60):
        rid = f"r{i}"
        device = place(kvs, KVRequest(rid, 16, 256, predicted_tokens=rng.uniform(1, 200)))
        if device is not None:
            where[rid] = device
            live.append(rid)
        if len(live) > 3 or device is None:  # a few stay live, so the load differs between devices
            done = live.pop(0)
            kvs[where[done]].release(done, rng.randint(1, 256))
        policy.buckets.refresh()
        assert len({kv.pool.policy.buckets.bounds for kv in kvs.values()}) == 1
    assert policy.buckets.version > 0  # bounds did move, and moved everywhere at once
    assert len(set(where.values())) == 3  # every device took requests


def test_equal_devices_share_the_load():
    _, kvs = pools(2)
    for i in range(10):
        assert place(kvs, KVRequest(f"r{i}", 32, 64, predicted_tokens=30)) is not None
    assert [kv.load(d).live_blocks for d, kv in kvs.items()] == [5, 5]


def test_memory_pressure_steers_away_from_a_full_device():
    _, kvs = pools(2)
    first = place(kvs, KVRequest("big", 600, 64, predicted_tokens=30), w_compute=0.0)
    other = "mlu:1" if first == "mlu:0" else "mlu:0"
    for i in range(3):
        assert place(kvs, KVRequest(f"s{i}", 64, 64, predicted_tokens=30), w_compute=0.0) == other


def test_queued_work_counts_as_load():
    _, kvs = pools(2)
    loads = [kvs["mlu:0"].load("mlu:0", queued_reserve=500, queued_tokens=400), kvs["mlu:1"].load("mlu:1")]
    assert rank_devices(loads, 64)[0] == "mlu:1"
    loads = [kvs["mlu:0"].load("mlu:0"), kvs["mlu:1"].load("mlu:1", queued_reserve=500, queued_tokens=400)]
    assert rank_devices(loads, 64)[0] == "mlu:0"


def test_a_full_cluster_refuses_and_every_pool_stays_consistent():
    _, kvs = pools(2, tokens=512)  # blocks of 100 + 64 (bucket bound) = 176 tokens: two per device
    placed = [place(kvs, KVRequest(f"r{i}", 100, 64, predicted_tokens=20)) for i in range(6)]
    assert all(p is not None for p in placed[:4]) and placed[4] is None and placed[5] is None
    assert sorted(placed[:4]) == ["mlu:0", "mlu:0", "mlu:1", "mlu:1"]
    for kv in kvs.values():
        kv.check()
