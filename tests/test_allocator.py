"""The pool's rules, one at a time: reservation sizes, free lists, regions, migration, bad input."""

from __future__ import annotations

import copy

import pytest

from odma.kv import BalloonPool, BucketManager, BucketPolicy, ExactPolicy, KVPool, KVRequest, LARGE, StaticPolicy
from odma.config import BucketConfig
from odma.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    OdmaError,
    RequestTooLargeError,
    UnknownRequestError,
)


def bucket_pool(total=1024, bounds=(32, 64, 128), large_bound=256, **kw) -> KVPool:
    return KVPool(total, BucketPolicy(BucketManager.fixed(bounds, large_bound), **kw.pop("policy_kw", {})), **kw)


class RecordingMover:
    def __init__(self):
        self.copies = []

    def copy(self, src, dst, n_tokens):
        self.copies.append((src, dst, n_tokens))


def _snapshot(pool: KVPool):
    return (copy.deepcopy(pool.stats()), {r: pool.block_of(r) for r in pool.live_requests()})


def test_capacity_is_prompt_plus_bucket_bound_aligned():
    pool = bucket_pool(align=16)
    block = pool.reserve(KVRequest("a", prompt_tokens=10, max_new_tokens=256, predicted_tokens=40))
    assert block.bucket == 1 and block.capacity == 80  # 10 + 64 = 74 → 80
    pool.check_invariants()


def test_uncertain_request_goes_to_the_large_bucket_and_region():
    pool = KVPool(1024, BucketPolicy(BucketManager.fixed((32, 64), 256, alpha=1.0, tau=0.5)), large_share=0.5, align=1)
    sure = pool.reserve(KVRequest("sure", 10, 256, predicted_tokens=20, uncertainty=0.2))
    unsure = pool.reserve(KVRequest("unsure", 10, 256, predicted_tokens=20, uncertainty=0.9))
    assert sure.bucket == 0 and sure.capacity == 10 + 32 and sure.region == "main"
    # alpha inflates: 20 * (1 + 1.0 * 0.2) = 24 still fits 32
    assert unsure.bucket == LARGE and unsure.capacity == 10 + 256 and unsure.region == "large"


def test_inflation_moves_to_a_larger_bucket():
    bm = BucketManager.fixed((32, 64), 256, alpha=1.0)
    assert bm.select(30, 0.0).bound == 32
    assert bm.select(30, 0.5).bound == 64  # 30 * 1.5 = 45


def test_static_reserves_worst_case_and_never_migrates():
    mover = RecordingMover()
    pool = KVPool(2048, StaticPolicy(), large_share=0.0, align=1, mover=mover)
    block = pool.reserve(KVRequest("a", 100, 300))
    assert block.capacity == 400
    for n in range(101, 401):
        assert pool.extend("a", n) == block
    assert mover.copies == []


def test_extend_migrates_to_next_bucket_and_copies_live_tokens():
    mover = RecordingMover()
    pool = bucket_pool(align=1, mover=mover)
    b0 = pool.reserve(KVRequest("a", 10, 256, predicted_tokens=20))
    assert b0.capacity == 42
    assert pool.extend("a", 42) == b0
    b1 = pool.extend("a", 43)
    assert b1 != b0 and b1.bucket == 1 and b1.capacity == 10 + 64
    assert mover.copies == [(b0, b1, 42)]  # the tokens held before the step, not the new one
    assert pool.length_of("a") == 43
    s = pool.stats()
    assert s.migrations == 1 and s.migrated_tokens == 42
    pool.check_invariants()


@pytest.mark.parametrize("growth,expect", [("large", 10 + 256), ("double", 10 + 64)])
def test_growth_policies(growth, expect):
    pool = bucket_pool(align=1, policy_kw={"growth": growth}, large_share=0.3)
    pool.reserve(KVRequest("a", 10, 256, predicted_tokens=20))
    assert pool.extend("a", 43).capacity == expect


def test_normal_requests_stay_out_of_the_large_region_but_migrations_may_use_it():
    pool = bucket_pool(total=400, align=1, large_share=0.5)  # main 200, large 200
    pool.reserve(KVRequest("a", 10, 150, predicted_tokens=20))  # 10 + 32 = 42 in main
    pool.reserve(KVRequest("b", 10, 150, predicted_tokens=100))  # 10 + 128 = 138 in main: 180 used
    assert pool.reserve(KVRequest("c", 10, 150, predicted_tokens=20)) is None  # 42 > 20 free in main
    grown = pool.extend("a", 43)  # next bucket: 10 + 64 = 74, only the large region has room
    assert grown.region == "large" and grown.capacity == 74
    pool.check_invariants()


def test_reserve_returns_none_under_pressure_and_counts_it():
    pool = KVPool(256, StaticPolicy(), large_share=0.0, align=16)
    assert pool.reserve(KVRequest("a", 100, 100)) is not None
    assert pool.reserve(KVRequest("b", 100, 100)) is None
    assert "b" not in pool and pool.stats().refusals == 1
    pool.release("a", 50)
    assert pool.reserve(KVRequest("b", 100, 100)) is not None


def test_extend_returns_none_when_migration_has_no_room_and_keeps_block():
    pool = bucket_pool(total=128, align=1, large_share=0.0)
    a = pool.reserve(KVRequest("a", 10, 100, predicted_tokens=20))
    pool.reserve(KVRequest("b", 10, 100, predicted_tokens=60))
    assert pool.extend("a", a.capacity + 1) is None
    assert pool.block_of("a") == a and pool.length_of("a") == 10
    assert pool.stats().migration_refusals == 1
    pool.check_invariants()


def test_free_list_reuses_and_splits_without_over_reserving():
    pool = bucket_pool(align=1, large_share=0.0)
    a = pool.reserve(KVRequest("a", 30, 256, predicted_tokens=20))  # 30 + 32
    pool.release("a", 5)
    b = pool.reserve(KVRequest("b", 10, 256, predicted_tokens=20))  # 10 + 32 from a's block
    assert b.offset == a.offset and b.capacity == 42
    assert pool.stats().free_list_hits == 1
    pool.check_invariants()


def test_free_lists_flush_before_refusing():
    pool = bucket_pool(total=256, align=1, large_share=0.0)
    for i in range(4):
        pool.reserve(KVRequest(f"s{i}", 16, 200, predicted_tokens=20))  # 4 x 48 = 192 tokens
    for i in range(4):
        pool.release(f"s{i}", 1)  # all on the bucket-0 free list
    big = pool.reserve(KVRequest("big", 60, 190, predicted_tokens=120))  # 60 + 128 = 188 needs a flush
    assert big is not None and pool.stats().flushes == 1
    pool.check_invariants()


def test_could_reserve_answers_like_reserve_without_allocating():
    pool = bucket_pool(total=256, align=1, large_share=0.0)
    for i in range(4):
        pool.reserve(KVRequest(f"s{i}", 16, 200, predicted_tokens=20))  # 4 x 48 = 192 tokens
    big = KVRequest("big", 60, 190, predicted_tokens=120)  # 188 tokens: 64 are free
    assert not pool.could_reserve(big) and pool.stats().live_blocks == 4
    for i in range(4):
        pool.release(f"s{i}", 1)  # cached on the bucket-0 free list, fragmenting the range
    assert pool.stats().largest_free_extent_tokens < 188
    assert pool.could_reserve(big)  # only after the flush it does itself, as a refused reserve would
    assert pool.stats().live_blocks == 0 and pool.reserve(big) is not None
    small = KVRequest("small", 10, 200, predicted_tokens=20)  # 42 tokens; 256 - 188 = 68 free
    assert pool.could_reserve(small) and pool.reserve(small) is not None
    assert not pool.could_reserve(KVRequest("more", 10, 200, predicted_tokens=20))
    pool.check_invariants()


def test_refresh_flushes_stale_free_lists():
    cfg = BucketConfig(max_buckets=2, align=8, min_samples=2, refresh_every_n=2, large_bound=256)
    bm = BucketManager(cfg, bootstrap=[10, 20])
    pool = KVPool(1024, BucketPolicy(bm), large_share=0.0, align=8)
    pool.reserve(KVRequest("a", 8, 256, predicted_tokens=5))
    pool.release("a", 5)
    assert pool.stats().cached_tokens > 0
    for n in (100, 200, 150, 120):
        bm.observe(n)
    assert bm.refresh()
    pool.reserve(KVRequest("b", 8, 256, predicted_tokens=5))
    assert pool.stats().flushes == 1
    pool.check_invariants()


BAD_REQUESTS = [
    KVRequest("", 10, 10),
    KVRequest("x", 0, 10),
    KVRequest("x", -5, 10),
    KVRequest("x", 10, 0),
    KVRequest("x", 10, 10, predicted_tokens=-1.0),
    KVRequest("x", 10, 10, predicted_tokens=float("nan")),
    KVRequest("x", 10, 10, predicted_tokens=5, uncertainty=float("inf")),
    KVRequest("x", 10.5, 10),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("req", BAD_REQUESTS)
def test_bad_requests_raise_and_change_nothing(req):
    pool = bucket_pool()
    pool.reserve(KVRequest("live", 10, 100, predicted_tokens=10))
    before = _snapshot(pool)
    with pytest.raises(InvalidRequestError):
        pool.reserve(req)
    assert _snapshot(pool) == before


def test_bad_lifecycle_calls_raise_clear_errors_and_change_nothing():
    pool = bucket_pool(align=1)
    pool.reserve(KVRequest("a", 10, 100, predicted_tokens=10))
    before = _snapshot(pool)
    cases = [
        (lambda: pool.reserve(KVRequest("a", 10, 100)), DuplicateRequestError),
        (lambda: pool.extend("nope", 20), UnknownRequestError),
        (lambda: pool.extend("a", 5), InvalidRequestError),  # shrinking below what is held
        (lambda: pool.extend("a", 10**9), InvalidRequestError),  # absurd
        (lambda: pool.extend("a", -1), InvalidRequestError),
        (lambda: pool.release("a", -3), InvalidRequestError),
        (lambda: pool.release("a", 10**9), InvalidRequestError),
        (lambda: pool.release("nope", 3), UnknownRequestError),
        (lambda: pool.reserve(KVRequest("huge", 10, 10**6)), RequestTooLargeError),
    ]
    for call, error in cases:
        with pytest.raises(error) as info:
            call()
        assert isinstance(info.value, OdmaError) and str(info.value)
        assert _snapshot(pool) == before
    pool.release("a", 3)
    with pytest.raises(UnknownRequestError, match="already released"):
        pool.release("a", 3)  # double release


def test_failed_copy_leaves_the_old_block_in_place():
    class BrokenMover:
        def copy(self, src, dst, n):
            raise RuntimeError("device error")

    pool = bucket_pool(align=1, mover=BrokenMover())
    a = pool.reserve(KVRequest("a", 10, 100, predicted_tokens=20))
    before = _snapshot(pool)
    with pytest.raises(RuntimeError):
        pool.extend("a", a.capacity + 1)
    assert _snapshot(pool) == before
    pool.check_invariants()


def test_exact_policy_reserves_the_prediction():
    pool = KVPool(1024, ExactPolicy(), align=1, large_share=0.0)
    assert pool.reserve(KVRequest("a", 7, 500, predicted_tokens=33.2)).capacity == 7 + 34


def test_release_feeds_the_bucket_manager_and_callback():
    seen = []
    cfg = BucketConfig(max_buckets=2, min_samples=1)
    bm = BucketManager(cfg)
    pool = KVPool(4096, BucketPolicy(bm), on_release=lambda r, n, b: seen.append((r.request_id, n)))
    pool.reserve(KVRequest("a", 10, 100, predicted_tokens=10))
    pool.release("a", 42)
    assert seen == [("a", 42)] and bm.window_lengths() == [42]


def test_stats_report_fragmentation():
    pool = KVPool(160, ExactPolicy(), align=16, large_share=0.0, free_list_limit=0)
    for i in range(5):
        pool.reserve(KVRequest(f"r{i}", 16, 100, predicted_tokens=16))  # 32 tokens each
    pool.release("r1", 1)
    pool.release("r3", 1)
    s = pool.stats()
    assert s.free_tokens == 64 and s.largest_free_extent_tokens == 32
    assert s.external_fragmentation == pytest.approx(0.5)
    assert s.reserved_tokens == 96 and s.live_tokens == 48


def test_segments_count_in_sizes_and_stats_until_drained():
    pool = KVPool(256, StaticPolicy(), large_share=0.0, align=16)  # 16 units
    assert pool.max_request_tokens == 256
    with pytest.raises(RequestTooLargeError):
        pool.reserve(KVRequest("big", 100, 300))
    balloon = BalloonPool(pool, 512)
    seg = balloon.inflate()  # 512 tokens, apart from the base range
    assert pool.max_request_tokens == 512 and pool.stats().total_tokens == 768
    assert pool.stats().main_tokens == 768 and pool.stats().free_tokens == 768
    big = pool.reserve(KVRequest("big", 100, 300))
    assert big.offset == seg.offset  # only the segment can hold it
    pool.release("big", 300)
    balloon.fence(seg)
    assert pool.max_request_tokens == 256  # a segment being drained no longer counts
    assert balloon.deflate(seg).freed_bytes == 512 * pool.bytes_per_token
    assert pool.stats().total_tokens == 256
    pool.check_invariants()


def test_reserve_scale_reserves_part_of_the_prediction_and_grows():
    pool = KVPool(4096, BucketPolicy(BucketManager.fixed((32, 64, 128), 256), reserve_scale=0.5), align=1)
    block = pool.reserve(KVRequest("a", 10, 256, predicted_tokens=100))  # 50 → the 64 bucket
    assert block.capacity == 10 + 64
    assert pool.extend("a", 10 + 65).capacity == 10 + 128  # grows into the next bucket


def test_growth_in_place_takes_the_free_units_after_the_block():
    mover = RecordingMover()
    pool = bucket_pool(total=256, align=1, large_share=0.0, mover=mover)
    a = pool.reserve(KVRequest("a", 10, 200, predicted_tokens=20))  # [0, 42)
    grown = pool.extend("a", 43)
    assert grown.offset == a.offset and grown.capacity == 10 + 64 and grown.bucket == 1
    assert mover.copies == [(a, grown, 10)]  # the K/V held so far is laid out for the larger capacity
    b = pool.reserve(KVRequest("b", 10, 200, predicted_tokens=20))  # right after a
    assert b.offset == grown.end
    moved = pool.extend("a", 75)  # the neighbour is taken: a migration to a new range
    assert moved.offset != grown.offset and moved.capacity == 10 + 128
    s = pool.stats()
    assert s.migrations == 2 and s.grown_in_place == 1
    pool.check_invariants()


def test_a_block_of_most_of_the_pool_grows_in_place_where_migration_cannot():
    pool = bucket_pool(total=256, align=1, large_share=0.0)
    big = pool.reserve(KVRequest("big", 150, 100, predicted_tokens=20))  # 182 of 256: no second range of 214
    assert pool.extend("big", 183).offset == big.offset
    pool.check_invariants()


def test_failed_in_place_layout_gives_back_only_the_extension():
    class BrokenMover:
        def copy(self, src, dst, n):
            raise RuntimeError("device error")

    pool = bucket_pool(total=256, align=1, large_share=0.0, mover=BrokenMover())
    a = pool.reserve(KVRequest("a", 10, 100, predicted_tokens=20))
    before = _snapshot(pool)
    with pytest.raises(RuntimeError):
        pool.extend("a", a.capacity + 1)
    assert _snapshot(pool) == before and pool.block_of("a") == a
    pool.check_invariants()


def test_requests_too_large_to_migrate_reserve_their_worst_case():
    pool = bucket_pool(total=1024, align=1, large_share=0.0, worst_case_prompt_share=0.5)
    big = pool.reserve(KVRequest("big", 520, 200, predicted_tokens=20))  # 520 > 512: it could only grow in place
    small = pool.reserve(KVRequest("small", 100, 200, predicted_tokens=20))  # the policy's 32-token bucket
    assert big.bucket == LARGE and big.capacity == 720
    assert small.bucket == 0 and small.capacity == 132
    with pytest.raises(InvalidRequestError, match="worst_case_prompt_share"):
        bucket_pool(worst_case_prompt_share=0.0)


def test_a_growth_hint_grows_straight_to_the_bucket_that_holds_it():
    """Without a hint a request outgrowing its block climbs one bucket per migration; with the engine's refined
    estimate of its whole output it migrates once, into the first bucket that holds it."""
    bounds = (16, 32, 64, 128, 256)
    moves = {}
    for hint in (None, 100.0):
        pool = KVPool(4096, BucketPolicy(BucketManager.fixed(bounds, 256)), large_share=0.0, align=16)
        req = KVRequest("r", 16, 256, predicted_tokens=10.0, growth_hint=hint)
        assert pool.reserve(req).capacity == 32  # 16 prompt + the 16 bucket
        caps = []
        for length in range(33, 16 + 110):
            block = pool.extend("r", length)
            if block.capacity not in caps:
                caps.append(block.capacity)
        moves[hint] = caps
        pool.check_invariants()
    assert moves[None] == [48, 80, 144]  # 32 → 64 → 128 output tokens: three growths
    assert moves[100.0] == [144]  # the 128 bucket holds the 100 hinted tokens: one growth
