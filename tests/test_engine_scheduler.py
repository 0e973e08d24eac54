"""The scheduler's bookkeeping over a real KVPool, without a model: admission order and its guards."""

from __future__ import annotations

from odma.kv import BucketManager, BucketPolicy, ContiguousKV, KVPool
from odma.engine.sampling import SamplingParams
from odma.engine.scheduler import Scheduler
from odma.engine.sequence import Sequence

BOUNDS = (8, 16, 32)  # a request reserves 8 prompt tokens + its bucket's bound


def _seq(i: int, bucket: int) -> Sequence:
    s = Sequence(f"r{i}", [1] * 8, SamplingParams(max_tokens=32))
    s.bucket = bucket
    s.predicted_tokens = s.predicted_length = float(BOUNDS[bucket])
    return s


def _scheduler(**kw) -> Scheduler:
    pool = KVPool(48, BucketPolicy(BucketManager.fixed(BOUNDS, 32)), large_share=0.0, align=8)
    return Scheduler(ContiguousKV(pool), **kw)


def _admitted(sched: Scheduler) -> list[str]:
    work = sched.schedule()
    for w in work:
        w.seq.num_cached = w.start + w.q_len
        w.seq.output_ids.append(5)
    return [w.seq.request_id for w in work if w.start == 0]


def test_a_request_tagged_with_a_just_freed_bucket_goes_first():
    sched = _scheduler(max_num_seqs=2)
    b = _seq(0, 0)  # 16 slots
    sched.add(b)
    assert _admitted(sched) == ["r0"]
    sched.add(_seq(1, 2))  # 40 slots, first in FIFO order
    sched.add(_seq(2, 0))  # 16 slots, the bucket b is about to free
    sched.finish(b, "stop")
    # both cannot fit together (56 > 48): the bucket-matched one takes b's block, the big one waits
    assert _admitted(sched) == ["r2"]
    assert sched.counters.bucket_matched_admissions == 1
    sched.kv.check()


def test_a_bypassed_head_of_queue_stops_being_overtaken():
    sched = _scheduler(max_num_seqs=8, max_skips=2)
    holder = _seq(0, 1)  # 24 slots for the whole test
    sched.add(holder)
    _admitted(sched)
    big = _seq(1, 2)  # 40 slots: must wait for the holder
    small = [_seq(i, 0) for i in range(2, 5)]  # 16 slots each: fit beside the holder
    for s in [big, *small]:
        sched.add(s)
    assert _admitted(sched) == ["r2"]  # overtakes big (waited 0 rounds)
    sched.finish(small[0], "stop")
    assert _admitted(sched) == ["r3"]  # overtakes big (waited 1 round)
    sched.finish(small[1], "stop")
    assert _admitted(sched) == []  # big has waited max_skips rounds: memory is held for it
    sched.finish(holder, "stop")
    assert _admitted(sched)[0] == "r1"
    sched.kv.check()


def test_admission_theta_keeps_headroom_for_growth_but_never_blocks_an_idle_pool():
    """eLLM Algorithm 1: with θ = 0.5 of a 48-slot pool, admissions stop once reservations would pass 24
    slots; an empty engine still admits a request bigger than that (no deadlock), and without θ the same
    queue fills the pool."""
    sched = _scheduler(max_num_seqs=8, admission_theta=0.5)
    big = _seq(0, 2)  # 40 slots > 24: admitted anyway, nothing is running
    sched.add(big)
    assert _admitted(sched) == ["r0"]
    sched.add(_seq(1, 0))  # 16 more would make 56 > 24
    assert _admitted(sched) == [] and sched.counters.theta_refusals == 1
    sched.finish(big, "stop")
    for i in (2, 3):
        sched.add(_seq(i, 0))
    assert _admitted(sched) == ["r1"]  # 16 ≤ 24; a second 16 would make 32 > 24
    assert sched.kv.reserved_tokens == 16
    free = _scheduler(max_num_seqs=8)
    for i in range(3):
        free.add(_seq(i, 0))
    assert _admitted(free) == ["r0", "r1", "r2"]  # 48 slots: the whole pool
    sched.kv.check()
