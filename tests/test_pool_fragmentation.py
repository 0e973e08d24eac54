"""The fragmentation figure reports what a reservation could actually get: blocks cached on the bucket free
lists rejoin their free neighbours in it (a refused carve flushes them), so an idle pool is not fragmented."""

from __future__ import annotations

import random

import pytest

from odma.kv import BucketManager, BucketPolicy, ExactPolicy, KVPool, KVRequest


@pytest.mark.parametrize("large_share", [0.0, 0.1])
def test_an_idle_pool_after_traffic_is_not_fragmented(large_share):
    pool = KVPool(4096, BucketPolicy(BucketManager.fixed((32, 64, 128, 256), 512)), align=16, large_share=large_share)
    rng = random.Random(0)
    live = []
    for i in range(400):  # churn: blocks of every bucket come and go, and end up cached on the free lists
        if live and rng.random() < 0.5:
            pool.release(live.pop(rng.randrange(len(live))), rng.randrange(1, 32))
        elif pool.reserve(KVRequest(f"r{i}", rng.randrange(8, 64), 512, predicted_tokens=rng.randrange(1, 300))):
            live.append(f"r{i}")
    for rid in live:
        pool.release(rid, 1)
    s = pool.stats()
    assert s.reserved_tokens == 0 and s.cached_tokens > 0  # idle, its free memory partly cached in blocks
    assert s.largest_free_extent_tokens < s.largest_range_tokens  # cached blocks cut the extents as they are
    assert s.largest_reservable_tokens == s.largest_range_tokens == pool.max_request_tokens
    assert s.external_fragmentation == 0.0


def test_a_hole_between_live_blocks_still_counts():
    pool = KVPool(160, ExactPolicy(), align=16, large_share=0.0)  # free lists on: released blocks are cached
    for i in range(5):
        pool.reserve(KVRequest(f"r{i}", 16, 100, predicted_tokens=16))  # 32 tokens each
    pool.release("r1", 1)
    pool.release("r3", 1)
    s = pool.stats()
    assert s.cached_tokens == 64 and s.largest_reservable_tokens == 32
    assert s.external_fragmentation == pytest.approx(0.5)  # 64 free, but no reservation gets more than 32
    pool.release("r2", 1)  # r1, r2, r3 are neighbours: one 96-token run once coalesced
    assert pool.stats().largest_reservable_tokens == 96 and pool.stats().external_fragmentation == 0.0
