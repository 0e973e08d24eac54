"""The scheduler's bookkeeping over a real KVPool, without a model: admission order and its guards."""

from __future__ import annotations

from collections import Counter

from odma.kv import BucketManager, BucketPolicy, ContiguousKV, KVPool
from odma.engine.admission import final_tokens
from odma.engine.prefill_cost import PLAIN_TOKENS
from odma.engine.sampling import SamplingParams
from odma.engine.scheduler import Scheduler
from odma.engine.scheduler_config import SchedulerConfig
from odma.engine.sequence import Sequence

BOUNDS = (8, 16, 32)  # a request reserves 8 prompt tokens + its bucket's bound


def _seq(i: int, bucket: int) -> Sequence:
    s = Sequence(f"r{i}", [1] * 8, SamplingParams(max_tokens=32))
    s.bucket = bucket
    s.predicted_tokens = s.predicted_length = float(BOUNDS[bucket])
    return s


def _scheduler(**kw) -> Scheduler:
    pool = KVPool(48, BucketPolicy(BucketManager.fixed(BOUNDS, 32)), large_share=0.0, align=8)
    return Scheduler(ContiguousKV(pool), SchedulerConfig(**{"prefill_cost": PLAIN_TOKENS, **kw}))


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


def _tagged(i: int, predicted: float) -> Sequence:
    """A 8-token prompt predicted to write `predicted` tokens (all reserve the smallest bucket: memory is no issue)."""
    s = Sequence(f"r{i}", [1] * 8, SamplingParams(max_tokens=32))
    s.predicted_length, s.predicted_tokens = predicted, 1.0
    return s


def test_admission_by_predicted_demand_stops_where_the_running_set_would_outgrow_the_pool():
    """Reservations start at the smallest bucket (16 slots), so the 48-slot pool alone admits three requests; each
    is predicted to end at 8 + 20 = 28 tokens, so with demand 1.0 only one runs (a second makes 56 > 48), with
    prediction 12 (ends at 20) two do. A request without a prediction counts its whole max_tokens (40), yet an
    idle engine still admits it (no deadlock)."""
    def admitted(demand, predicted):
        sched = _scheduler(max_num_seqs=8, admission_demand=demand)
        for i, p in enumerate(predicted):
            sched.add(_tagged(i, p) if p is not None else Sequence(f"r{i}", [1] * 8, SamplingParams(max_tokens=32)))
        names = _admitted(sched)
        sched.kv.check()
        return names, sched.counters.demand_refusals

    assert admitted(None, [20, 20, 20]) == (["r0", "r1", "r2"], 0)  # the pool alone: three small blocks
    assert admitted(1.0, [20, 20, 20]) == (["r0"], 2)
    assert admitted(1.0, [12, 12, 12]) == (["r0", "r1"], 1)
    assert admitted(1.5, [20, 20, 20]) == (["r0", "r1"], 1)  # 56 <= 72, 84 > 72
    assert admitted(1.0, [None, 12]) == (["r0"], 1)  # 40 + 20 > 48


def test_predicted_final_tokens_shrink_with_progress_and_never_undercount_what_is_held():
    seq = _tagged(0, 20)
    assert final_tokens(seq) == 28
    seq.output_ids.extend([5] * 15)
    assert final_tokens(seq) == 28  # 23 held + 5 predicted to come
    seq.output_ids.extend([5] * 10)  # past its prediction: what it holds
    assert final_tokens(seq) == 33
    seq.predicted_remaining = 100.0  # a refined estimate beyond max_tokens is capped at max_tokens
    assert final_tokens(seq) == 8 + 32


def test_sjf_admits_the_shortest_predicted_first_and_fcfs_keeps_arrival_order():
    lengths = [30, 5, 20, 1, 12]
    for order, expected in (("sjf", ["r3", "r1"]), ("fcfs", ["r0", "r1"])):
        sched = _scheduler(max_num_seqs=2, order=order)
        for i, n in enumerate(lengths):
            sched.add(_tagged(i, n))
        assert _admitted(sched) == expected, order
    sched = _scheduler(max_num_seqs=5, order="sjf")
    unknown = Sequence("r9", [1] * 8, SamplingParams(max_tokens=32))  # no prediction: last
    for s in [unknown, _tagged(0, 9), _tagged(1, 3)]:
        sched.add(s)
    assert [s.request_id for s in sched.order.candidates(sched.waiting, Counter())] == ["r1", "r0", "r9"]


def test_sjf_aging_bounds_the_wait_of_a_long_request_under_a_stream_of_short_ones():
    """One long request among short ones that keep arriving, one admission slot per round: without aging the long
    one would wait as long as short ones come; with aging it is served within aging_rounds + 1 rounds."""
    for aging, served in ((5, True), (10_000, False)):
        sched = _scheduler(max_num_seqs=1, order="sjf", aging_rounds=aging)
        sched.add(_tagged(0, 30))
        waited = None
        for rnd in range(40):
            sched.add(_tagged(100 + rnd, 2))  # a short one arrives every round
            admitted = _admitted(sched)
            assert len(admitted) == 1
            if admitted == ["r0"]:
                waited = rnd
                break
            sched.finish(next(s for s in sched.running), "stop")  # the short one finishes at once
        assert (waited is not None) == served, aging
        if served:
            assert waited <= aging + 1


def test_sjf_aging_counts_against_the_newest_arrival_so_a_burst_stays_shortest_first():
    """Twelve requests at once, one admitted per round, aging after 3 rounds: requests that arrived together age
    together, so the burst is served shortest first (aging by the clock turned it into arrival order from the
    fourth round on); once a newer request waits behind them, the rest, 8 rounds older, go first in arrival
    order."""
    lengths = [25, 3, 17, 9, 30, 1, 21, 13, 5, 27, 11, 7]
    sched = _scheduler(max_num_seqs=1, order="sjf", aging_rounds=3)
    for i, n in enumerate(lengths):
        sched.add(_tagged(i, n))
    served = []
    for _ in range(8):
        served += _admitted(sched)
        sched.finish(next(s for s in sched.running), "stop")
    by_length = sorted(range(len(lengths)), key=lambda i: lengths[i])
    assert served == [f"r{i}" for i in by_length[:8]]
    sched.add(_tagged(99, 1))  # newer and shorter than all of them, yet served after them
    for _ in range(5):
        served += _admitted(sched)
        sched.finish(next(s for s in sched.running), "stop")
    assert served[8:] == [*(f"r{i}" for i in sorted(by_length[8:])), "r99"]  # 25, 30, 21, 27 by arrival


def test_sjf_preempts_the_request_with_the_most_predicted_work_left():
    # 48 slots: three 16-slot blocks; when r1 must grow, the victim is the one predicted longest (not the newest)
    sched = _scheduler(max_num_seqs=3, order="sjf", preempt="recompute")
    seqs = [_tagged(0, 4), _tagged(1, 6), _tagged(2, 3)]
    seqs[0].predicted_length = 25  # the longest predicted
    for s in seqs:
        sched.add(s)
    assert sorted(_admitted(sched)) == ["r0", "r1", "r2"]
    r1 = seqs[1]
    r1.output_ids += [5] * 8  # r1 outgrew its 16-slot block: needs 24 slots, none free
    r1.num_cached = r1.num_tokens - 1
    sched.schedule()
    assert seqs[0].preemptions == 1 and r1.preemptions == 0 and seqs[2].preemptions == 0
    sched.kv.check()


def test_a_victim_already_planned_this_step_is_taken_out_of_the_step():
    """sjf may preempt a request that grew (and was planned) earlier in the same step, once the length probe has
    refined its remaining work upwards; the step must not keep it: its block is gone, and a model step over it
    failed every request of that step (seen on odma-serve with --schedule sjf --probe probe under Poisson load:
    130 of 300 requests)."""
    from odma.engine.sequence import Status

    sched = _scheduler(max_num_seqs=3, order="sjf", preempt="recompute")
    seqs = [_tagged(0, 4), _tagged(1, 6), _tagged(2, 3)]
    for s in seqs:
        sched.add(s)
    assert _admitted(sched) == ["r2", "r0", "r1"]  # shortest predicted first: r2 runs first in every step
    seqs[2].predicted_remaining = 100.0  # the probe now expects r2 to run long: the victim, planned before r1
    r1 = seqs[1]
    r1.output_ids += [5] * 8  # r1 outgrew its 16-slot block: needs 24 slots, none free
    r1.num_cached = r1.num_tokens - 1
    work = sched.schedule()
    assert seqs[2].preemptions == 1 and r1.preemptions == 0  # (r0 goes too: r1 needs 24 contiguous slots)
    planned = [w.seq.request_id for w in work]
    assert "r2" not in planned and "r1" in planned
    assert all(w.seq.status is Status.RUNNING and w.seq.block is not None for w in work)
    sched.kv.check()


def _long(i: int, prompt: int) -> Sequence:
    s = Sequence(f"long{i}", [1] * prompt, SamplingParams(max_tokens=8))
    s.bucket, s.predicted_tokens = 0, 8.0
    return s


def _step(sched: Scheduler):
    work = sched.schedule()
    for w in work:
        w.seq.num_cached = w.start + w.q_len
        if w.seq.num_cached == w.seq.num_tokens:
            w.seq.output_ids.append(5)
    return work


def _long_scheduler(**kw) -> Scheduler:
    pool = KVPool(512, BucketPolicy(BucketManager.fixed((8, 16), 16)), large_share=0.0, align=8)
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_prefill_tokens": 64, "prefill_cost": PLAIN_TOKENS, **kw})
    return Scheduler(ContiguousKV(pool), config)


def test_a_long_prompt_is_chunked_and_the_running_streams_get_a_token_every_step():
    sched = _long_scheduler(chunk_prefills=True)
    streams = [_seq(i, 0) for i in range(3)]
    for s in streams:
        sched.add(s)
    _step(sched)  # the streams' prompts
    first, second = _long(0, 150), _long(1, 100)
    sched.add(first)
    sched.add(second)
    fed: dict[str, list[int]] = {"long0": [], "long1": []}
    for _ in range(6):
        work = _step(sched)
        assert {w.seq.request_id for w in work if w.q_len == 1} >= {"r0", "r1", "r2"}  # every step decodes them
        assert sum(w.q_len for w in work if w.q_len > 1) <= 64  # the step's prefill budget
        for w in work:
            if w.seq.request_id in fed and w.q_len > 1:
                fed[w.seq.request_id].append(w.q_len)
    # 150 tokens in chunks of the budget, the earlier prompt's chunks before the later one's; then the later one
    assert fed["long0"] == [64, 64, 22] and sum(fed["long1"]) == 100 and fed["long1"][0] == 42
    assert first.num_generated >= 1 and second.num_generated >= 1  # both prompts done within the six steps
    sched.kv.check()


def test_without_chunking_a_long_prompt_passes_whole_and_alone():
    sched = _long_scheduler(chunk_prefills=False)
    sched.add(_long(0, 150))
    sched.add(_long(1, 100))
    work = _step(sched)
    assert [(w.seq.request_id, w.q_len) for w in work] == [("long0", 150)]  # longer than the budget: alone, whole


def test_with_a_prefill_cost_a_late_chunk_of_a_long_prompt_is_smaller():
    from odma.engine.prefill_cost import PrefillCost

    cost = PrefillCost(span=100.0)  # at 100 cached tokens a prompt token's attention costs as much as the rest
    sched = _long_scheduler(chunk_prefills=True, prefill_cost=cost)
    sched.add(_long(0, 400))
    chunks, starts = [], []
    while not chunks or sum(chunks) < 400:
        work = [w for w in _step(sched) if w.q_len > 1]
        assert len(work) == 1
        starts.append(work[0].start)
        chunks.append(work[0].q_len)
        assert cost(work[0].start, work[0].q_len) <= 64  # never past the step's budget
    assert sum(chunks) == 400 and starts == [sum(chunks[:i]) for i in range(len(chunks))]
    assert chunks == sorted(chunks, reverse=True) and chunks[0] > 2 * chunks[-2]  # deeper: fewer tokens a step
    sched.kv.check()


def test_a_prompt_deep_in_its_context_advances_even_when_one_token_costs_more_than_the_budget():
    from odma.engine.prefill_cost import PrefillCost

    sched = _long_scheduler(chunk_prefills=True, prefill_cost=PrefillCost(span=1.0))
    seq = _long(0, 200)
    sched.add(seq)
    for _ in range(100):
        _step(sched)
    # from position 64 on one token costs more than the budget of 64: fed one token a step, not stuck there
    assert 100 < seq.num_cached < 200
    sched.kv.check()


def test_the_prefill_cost_fits_the_most_tokens_within_a_budget():
    import random

    from odma.engine.prefill_cost import PrefillCost
    from odma.models.config import ModelConfig

    rng = random.Random(0)
    for span in (None, 1.0, 37.5, 1536.0):
        cost = PrefillCost(span)
        for _ in range(300):
            start, want, budget = rng.randrange(0, 20000), rng.randrange(1, 5000), rng.uniform(-5, 3000)
            q = cost.fit(start, want, budget)
            assert 0 <= q <= want and (q == 0 or cost(start, q) <= budget)
            assert q == want or cost(start, q + 1) > budget  # the most that fit
    assert PrefillCost()(100, 64) == 64  # no model: tokens only
    smollm2 = ModelConfig.from_hf_dict({"model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
                                        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                                        "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "rope_theta": 1e5,
                                        "max_position_embeddings": 8192, "tie_word_embeddings": True})
    # per layer 3.54 M weights (q, k, v, o, gate, up, down) against 4·576 FLOPs a cached position, at half speed
    assert PrefillCost.for_model(smollm2).span == 0.5 * 2 * 3_538_944 / (4 * 576)


def test_adaptive_admits_in_arrival_order_while_no_more_wait_than_can_run():
    lengths = [30, 5, 20, 1, 12]
    sched = _scheduler(max_num_seqs=5, order="adaptive")
    for i, n in enumerate(lengths[:5]):
        sched.add(_tagged(i, n))
    assert [s.request_id for s in sched.order.candidates(sched.waiting, Counter())] == ["r0", "r1", "r2", "r3", "r4"]
    sched.add(_tagged(5, 2))  # six wait for five places: shortest predicted first
    assert [s.request_id for s in sched.order.candidates(sched.waiting, Counter())][:3] == ["r3", "r5", "r1"]


def test_admission_rules_compose_each_refusal_counted_under_its_rule_and_an_idle_engine_always_admits():
    class OnePerRound:  # a rule written outside the scheduler: at most one new request per round
        counter = "admission_refusals"

        def begin_round(self, running, kv):
            self.started = 0

        def allows(self, seq, kv):
            return self.started < 1

        def admitted(self, seq):
            self.started += 1

    sched = _scheduler(max_num_seqs=8, custom_admission=(OnePerRound,), admission_demand=1.0)
    for i in range(3):
        sched.add(_tagged(i, 12))
    assert _admitted(sched) == ["r0"]  # the idle engine admits r0; r1 is refused by OnePerRound (asked first)
    assert (sched.counters.admission_refusals, sched.counters.demand_refusals) == (2, 0)
    assert _admitted(sched) == ["r1"]  # a new round: demand 20 + 20 <= 48
    assert _admitted(sched) == []  # 60 > 48: refused by demand
    assert sched.counters.demand_refusals == 1
    sched.kv.check()
