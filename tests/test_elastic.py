"""ElasticKV (torch-free): lending idle activation room to the KV pool and taking it back for prefills."""

from __future__ import annotations

import pytest

from odma.kv import ActivationProfile, BalloonPool, ContiguousKV, ElasticKV, KVPool, KVRequest, StaticPolicy
from odma.errors import ConfigError

PER_TOKEN = 10  # activation bytes per prefill token; KV is 1 byte per token


def _elastic(keep_tokens=8, reserve_tokens=100):
    pool = KVPool(256, StaticPolicy(), large_share=0.0, align=16)
    profile = ActivationProfile({1: PER_TOKEN, reserve_tokens: PER_TOKEN * reserve_tokens})
    return pool, ElasticKV(BalloonPool(pool, 160), profile, PER_TOKEN * reserve_tokens, keep_tokens=keep_tokens)


def test_lends_only_what_no_prefill_needs():
    pool, e = _elastic()
    assert e.lend(max_segments=10) == 5  # 1000 B of room, 80 B kept, segments of 160 B
    assert e.lent_bytes == 800 and pool.capacity_tokens == 256 + 800
    e.check(prefill_tokens=8)
    with pytest.raises(AssertionError):
        e.check(prefill_tokens=50)  # 500 B of activations would not fit beside 800 B lent
    _, e2 = _elastic()
    assert e2.lend(prefill_tokens=50, max_segments=10) == 3  # keeps the room of the prefill about to run


def test_make_room_deflates_and_moves_blocks_out():
    pool, e = _elastic()
    e.lend(max_segments=10)
    # fill the base range so the next blocks land in segments, then free the base
    base = [KVRequest(f"b{i}", 100, 28) for i in range(2)]
    assert all(pool.reserve(r) is not None for r in base)
    inside = KVRequest("s", 100, 28)
    block = pool.reserve(inside)
    assert block is not None and block.offset >= 256  # in a lent segment
    for r in base:
        pool.release(r, 0)
    ok, moved = e.make_room(prefill_tokens=100)  # the whole reserve
    assert ok and moved == 1 and e.lent_bytes == 0
    assert pool.block_of("s").offset < 256  # evacuated by migration into the base range
    e.check(prefill_tokens=100)
    pool.check_invariants()


def test_a_prefill_that_cannot_get_its_room_is_refused_and_blocks_lending():
    pool, e = _elastic()
    e.lend(max_segments=10)
    held = [KVRequest(f"r{i}", 100, 28) for i in range(6)]
    placed = [r for r in held if pool.reserve(r) is not None]
    assert len(placed) >= 3  # the base range is full, the rest sit in segments
    e.begin_round()
    ok, _ = e.make_room(prefill_tokens=100)
    assert not ok and e.counters.reclaim_failures == 1
    assert e.lend(max_segments=10) == 0  # nothing lent out of the room the refused prefill waits for
    pool.check_invariants()


def test_prefill_longer_than_the_reserve_runs_with_nothing_lent():
    pool, e = _elastic()
    e.lend(max_segments=1)
    ok, _ = e.make_room(prefill_tokens=400)  # e.g. a recomputed request: needs all of the reserve, not more
    assert ok and e.lent_bytes == 0
    e.check(prefill_tokens=400)


def test_bad_configuration_is_refused():
    pool = KVPool(256, StaticPolicy(), align=16)
    profile = ActivationProfile({1: 1})
    with pytest.raises(ConfigError):
        ElasticKV(BalloonPool(pool, 16), profile, -1)
    with pytest.raises(ConfigError):
        ElasticKV(BalloonPool(pool, 16), profile, 100, keep_tokens=0)


def _seq(rid: str, prompt: int, new: int):
    from odma.engine.sampling import SamplingParams
    from odma.engine.sequence import Sequence

    return Sequence(rid, [1] * prompt, SamplingParams(max_tokens=new))


def _step(sched) -> list[str]:
    work = sched.schedule()
    for w in work:  # what a model step does to the bookkeeping
        w.seq.num_cached = w.start + w.q_len
        w.seq.output_ids.append(5)
    return [w.seq.request_id for w in work]


def test_a_head_without_a_kv_block_does_not_hold_back_lending():
    """The scheduler keeps the activation room of the next waiting prefill unlent, but only while that
    request could get its KV block: a long prompt still waiting for KV memory is not about to prefill."""
    from odma.engine.prefill_cost import PLAIN_TOKENS
    from odma.engine.scheduler import Scheduler
    from odma.engine.scheduler_config import SchedulerConfig

    config = SchedulerConfig(max_num_seqs=8, max_prefill_tokens=256, prefill_cost=PLAIN_TOKENS)
    pool, e = _elastic()
    sched = Scheduler(ContiguousKV(pool, elastic=e), config)
    sched.add(_seq("holder", 100, 100))  # 200 of the 256 base tokens
    assert _step(sched) == ["holder"]
    sched.add(_seq("long", 90, 10))  # needs 100 KV tokens (56 free) and a 900 B prefill room
    assert _step(sched) == ["holder"]
    assert e.lent_bytes == 4 * 160  # lent while "long" cannot get its block (4 segments per step at most)
    pool2, e2 = _elastic()
    sched2 = Scheduler(ContiguousKV(pool2, elastic=e2), config)
    sched2.add(_seq("holder", 60, 60))  # 120 tokens: "long" fits beside it
    _step(sched2)
    sched2.add(_seq("long", 90, 10))
    sched2.add(_seq("blocked", 100, 100))  # refused for KV, so the scheduler would like to lend
    assert _step(sched2) == ["holder", "long"]
    assert e2.lent_bytes == 0  # nothing out of the room of the prefill that can start


def test_chunked_prefill_takes_the_free_room_and_never_moves_blocks():
    pool, e = _elastic()
    assert e.prefill_room(planned=0, want=100) == 100  # nothing lent: the whole prompt at once
    e.lend(max_segments=10)  # 5 segments, 200 B of room left
    held = [KVRequest(f"r{i}", 100, 28) for i in range(7)]
    assert all(pool.reserve(r) is not None for r in held)  # one in each segment, 2 in the base range
    assert e.prefill_room(planned=0, want=100) == 20  # 200 B of room: a 20-token chunk
    assert e.prefill_room(planned=15, want=100) == 5  # a step already prefilling 15 tokens
    assert e.prefill_room(planned=0, want=0) == 0
    assert e.balloon.metrics.deflations == 0 and e.balloon.metrics.moved_blocks == 0
    assert pool.block_of(held[0]).offset >= 256
    pool.release(held[0], 0)  # its segment is empty now: given back, nothing moves
    assert e.prefill_room(planned=0, want=100) == 36
    assert e.balloon.metrics.deflations == 1 and e.balloon.metrics.moved_blocks == 0 and e.counters.reclaims == 1
    e.check(prefill_tokens=36)
    pool.check_invariants()
