"""odma.vllm's parts that need no vLLM: contiguous runs over a block pool, the length-aware queue, the plugin's
config and the length tags."""

from __future__ import annotations

import math
import random
import pytest

from odma.engine.length_predictor import LoadedPredictor
from odma.errors import ConfigError
from odma.vllm.config import PluginConfig
from odma.vllm.order import ShortestFirstQueue
from odma.vllm.runs import BlockRuns
from odma.vllm.tagging import LengthTags, remaining, user_text
from predictor.running_median import RunningMedian

from fake_predictors import Answers

# -- runs ------------------------------------------------------------------------------------------------


def test_run_grows_in_place_inside_its_claim_and_returns_the_claim_on_drop():
    runs = BlockRuns(32, reserved=(0,))
    ids = runs.place("a", 2, claim=6)
    assert ids == list(range(ids[0], ids[0] + 2))
    assert runs.grow("a", 1) == [ids[0] + 2]
    assert runs.grow("a", 3) == list(range(ids[0] + 3, ids[0] + 6))
    assert runs.stats.grown_in_place == 2 and runs.pieces("a") == 1
    assert runs.free == 31 - 6  # the claim's unused ids count as free while it lives
    runs.give_back(list(range(ids[0], ids[0] + 6)))
    runs.drop("a")
    runs.check(set(range(1, 32)))
    assert runs.stats.finished_one_run == 1


def test_a_new_run_starts_halfway_into_the_slack_after_a_live_run():
    runs = BlockRuns(16)
    assert runs.place("a", 1, claim=2) == [0]  # the pool's start: nobody before it
    assert runs.place("b", 1, claim=2) == [8]  # a's claim ends at 2: b leaves a half of [2, 16)'s slack
    assert runs.place("c", 1, claim=2) == [4]  # [2, 8) and [10, 16) tie: the lower, halfway after a
    runs.check()


def test_growth_past_the_claim_takes_the_next_free_ids_else_appends_a_piece():
    runs = BlockRuns(16)
    assert runs.place("a", 1, claim=2) == [0]
    assert runs.grow("a", 1) == [1]
    assert runs.grow("a", 1) == [2]  # past its claim: id 2 is free and unclaimed, the run extends in place
    runs.taken_elsewhere([3])  # the pool hands id 3 out by itself
    appended = runs.grow("a", 1)
    assert appended != [3] and runs.pieces("a") == 2
    assert runs.stats.grown_in_place == 2 and runs.stats.appended == 1
    assert runs.stats.appended_with_room == 1  # a free extent could have held all 4 blocks: a move would have helped
    assert runs.grow("a", 1) == [appended[0] + 1]  # it grows from its new piece, in place
    runs.check()


def test_a_run_that_cannot_grow_in_place_moves_whole_to_a_larger_place():
    runs = BlockRuns(32)
    assert runs.place("a", 2, claim=2) == [0, 1]
    runs.taken_elsewhere([2])  # its neighbour is taken: no growth in place
    assert not runs.fits_in_place("a", 1)
    ids = runs.move("a", held=2, n=1, claim=6)
    assert ids == list(range(ids[0], ids[0] + 3)) and 2 not in ids  # one run: 2 copy targets and the new block
    assert runs.pieces("a") == 1 and runs.stats.moved == 1 and runs.stats.moved_blocks == 2
    assert runs.fits_in_place("a", 3)  # it moved with room: its claim of 6 holds 3 more
    runs.give_back([0, 1])  # the old ids come back once the copy ran
    runs.check(set(range(32)) - {2} - set(ids))
    runs.give_back(ids)
    runs.drop("a")
    assert runs.stats.finished_one_run == 1


def test_a_move_is_refused_when_no_extent_holds_the_run_or_the_pool_is_nearly_full():
    runs = BlockRuns(10)
    runs.place("a", 3, claim=3)  # 0-2
    runs.taken_elsewhere([3, 6])  # free: [4, 6) and [7, 10)
    assert runs.move("a", held=3, n=1, claim=8) is None  # no free extent holds 4 blocks
    runs.check(set(range(4, 10)) - {6})
    runs = BlockRuns(10)
    runs.place("a", 2, claim=2)  # 0-1
    runs.taken_elsewhere([2])
    assert runs.move("a", held=2, n=1, claim=3) is not None  # 7 free: 3 for the run and 2 spare for the old copy
    runs = BlockRuns(6)
    runs.place("a", 2, claim=2)  # 0-1
    runs.taken_elsewhere([2])
    assert runs.move("a", held=2, n=1, claim=3) is None  # 3 free: the run fits but both copies would fill the pool
    assert runs.pieces("a") == 1 and runs.stats.moved == 0


def test_claims_are_stolen_only_when_no_unclaimed_block_is_left_largest_claim_end_first():
    runs = BlockRuns(10)
    runs.place("a", 1, claim=6)  # 0-5
    runs.place("b", 1, claim=4)  # 6-9
    assert runs.avail.free_units == 0 and runs.free == 8
    got = runs.take(3)
    assert got == [3, 4, 5]  # the end of a's claim, the largest free tail
    assert runs.stats.stolen == 3
    assert runs.grow("a", 2) == [1, 2]  # a keeps its nearest growth
    with pytest.raises(ValueError, match="cannot get"):
        runs.take(4)  # 3 free (b's tail): asking more is refused, nothing changes
    runs.check()


def test_a_block_taken_by_the_pool_itself_cuts_the_claim_it_lay_in():
    runs = BlockRuns(12)
    runs.place("a", 1, claim=8)  # 0-7
    runs.taken_elsewhere([4])  # a prefix-cache hit on a free cached block inside a's claim
    assert runs.owners["a"].run.end == 4
    runs.check(set(range(1, 12)) - {4})


def test_the_youngest_cached_blocks_are_kept_from_runs_and_join_oldest_first():
    runs = BlockRuns(21, reserved=(0,), keep=0.5)  # ids 1..20 free
    a = runs.place("a", 10, 10)  # 1..10
    runs.give_back(a, cached=set(a))  # a full, hashed prompt's blocks: freed in this order (vLLM's eviction order)
    runs.drop("a")
    assert runs.free == 20 and len(runs.cached) == 10  # 10 of 20 free: within keep
    b = runs.place("b", 6, 6)
    assert set(b) <= set(range(11, 21))  # the blocks without a cache entry, not the kept ones
    # now 14 free, 10 of them kept: more than half, so the oldest joined the rest
    assert list(runs.cached) == a[3:] and runs.avail.free_units == 4 + 3
    runs.taken_elsewhere([a[5]])  # a prefix hit on a kept block: out of the mirror
    assert a[5] not in runs.cached
    c = runs.take(12)  # more than the rest holds: the kept blocks go too, oldest first
    assert set(c) == set(range(17, 21)) | {1, 2, 3} | {4, 5, 7, 8, 9} and runs.free == 1
    assert not runs.cached  # one free block left: none kept (at most half of the free ones)
    runs.check(set(range(1, 21)) - set(b) - set(c) - {a[5]})


def test_with_nothing_kept_runs_evict_any_cached_block():
    runs = BlockRuns(11, reserved=(0,), keep=0.0)
    a = runs.place("a", 5, 5)
    runs.give_back(a, cached=set(a))
    runs.drop("a")
    assert not runs.cached and runs.avail.largest() == 10  # all free ids one extent again: runs may use any


def test_runs_mirror_a_pool_through_random_traffic():
    rng = random.Random(7)
    n = 48
    runs = BlockRuns(n, reserved=(0,))
    free, held = set(range(1, n)), {}
    for _ in range(6000):
        op = rng.random()
        if op < 0.4:
            owner, k = f"r{rng.randrange(30)}", rng.randint(1, 4)
            if k > len(free):
                continue
            moved = None
            if owner in held and owner in runs.owners and not runs.fits_in_place(owner, k) and rng.random() < 0.5:
                moved = runs.move(owner, len(held[owner]), k, 2 * (len(held[owner]) + k))
            if moved is not None:  # copied over, then the old ids come back
                assert len(moved) == len(held[owner]) + k and set(moved) <= free and runs.pieces(owner) == 1
                free -= set(moved)
                runs.check(free)
                runs.give_back(held[owner])
                free |= set(held[owner])
                held[owner] = moved
            else:
                ids = runs.grow(owner, k) if owner in held else runs.place(owner, k, rng.randint(1, 10))
                assert len(ids) == k and set(ids) <= free
                free -= set(ids)
                held.setdefault(owner, []).extend(ids)
        elif op < 0.5 and free:
            i = rng.choice(sorted(free))
            runs.taken_elsewhere([i])
            free.discard(i)
            held.setdefault("pool", []).append(i)
        elif held:
            owner = rng.choice(sorted(held))
            ids = held.pop(owner)
            runs.give_back(ids, cached={i for i in ids if rng.random() < 0.5})  # half still hold a cache entry
            free |= set(ids)
            if owner != "pool":
                runs.drop(owner)
        runs.check(free)
    assert runs.stats.placed > 1000 and 0 < runs.stats.finished_one_run < runs.stats.finished
    assert runs.stats.moved >= 5  # moves interleaved with everything else


# -- order -----------------------------------------------------------------------------------------------


class _Req:  # hashed by identity, as vLLM's Request is
    def __init__(self, name: str, predicted: float) -> None:
        self.name, self.predicted = name, predicted


def _req(name: str, predicted: float) -> _Req:
    return _Req(name, predicted)


def _drain(queue):
    out = []
    while queue:
        out.append(queue.pop_request().name)
    return out


def test_sjf_serves_the_shortest_predicted_first_and_unknown_last():
    q = ShortestFirstQueue(lambda r: r.predicted, aging_rounds=100)
    for name, p in (("a", 300), ("b", math.inf), ("c", 20), ("d", 20), ("e", 90)):
        q.add_request(_req(name, p))
    assert len(q) == 5 and [r.name for r in q] == ["c", "d", "e", "a", "b"]
    assert _drain(q) == ["c", "d", "e", "a", "b"]
    assert q.reordered == 3  # c, d... : every pop that was not the oldest waiting


def test_aging_puts_a_long_waiter_before_every_younger_request_in_arrival_order():
    q = ShortestFirstQueue(lambda r: r.predicted, aging_rounds=3)
    long1, long2 = _req("long1", 900), _req("long2", 800)
    q.add_request(long1)
    q.add_request(long2)
    for i in range(3):
        q.add_request(_req(f"s{i}", 10))
        assert q.pop_request().name == f"s{i}"
        q.new_round()
    q.add_request(_req("fresh", 1))
    assert _drain(q) == ["long1", "long2", "fresh"]


def test_a_burst_ages_together_and_stays_shortest_first_until_a_newer_request_waits_behind_it():
    q = ShortestFirstQueue(lambda r: r.predicted, aging_rounds=3)
    lengths = {"a": 50, "b": 5, "c": 40, "d": 1, "e": 30, "f": 20, "g": 10}
    for name, p in lengths.items():
        q.add_request(_req(name, p))
    served = []
    for _ in range(4):  # 4 rounds > aging_rounds: aged by the clock, this would be arrival order by now
        served.append(q.pop_request().name)
        q.new_round()
    assert served == ["d", "b", "g", "f"]
    q.add_request(_req("fresh", 2))  # the burst's rest arrived 4 rounds before it: aged, in arrival order
    assert _drain(q) == ["a", "c", "e", "fresh"]


def test_a_put_back_request_keeps_its_age_and_removed_ones_never_come_back():
    q = ShortestFirstQueue(lambda r: r.predicted, aging_rounds=2)
    old = _req("old", 500)
    q.add_request(old)
    q.peek_request()
    q.new_round()
    q.new_round()
    popped = q.pop_request()
    q.prepend_request(popped)  # skipped this step: back in the queue, still aged
    gone = _req("gone", 1)
    q.add_request(gone)
    q.add_request(_req("short", 5))
    q.remove_requests([gone])
    assert _drain(q) == ["old", "short"]


def test_adaptive_is_arrival_order_while_the_queue_is_shallow():
    q = ShortestFirstQueue(lambda r: r.predicted, aging_rounds=100, depth=3)
    for name, p in (("a", 300), ("b", 5), ("c", 1)):
        q.add_request(_req(name, p))
    assert q.peek_request().name == "a"  # 3 waiting, depth 3: shallow
    q.add_request(_req("d", 2))
    assert q.peek_request().name == "c"  # 4 waiting: shortest first
    assert _drain(q) == ["c", "a", "b", "d"]  # after c, 3 are left: arrival order again


# -- config ----------------------------------------------------------------------------------------------


def test_plugin_config_reads_additional_config_and_env_and_refuses_in_words():
    cfg = PluginConfig.from_sources({"odma": {"order": "sjf", "aging_rounds": 64}}, env={})
    assert cfg.order == "sjf" and cfg.aging_rounds == 64 and cfg.runs
    cfg = PluginConfig.from_sources({}, env={"ODMA_VLLM_RUNS": "off", "ODMA_VLLM_ORDER": "fcfs"})
    assert not cfg.runs and cfg.order == "fcfs"
    with pytest.raises(ConfigError, match="unknown setting.*'orders'"):
        PluginConfig.from_sources({"odma": {"orders": "sjf"}}, env={})
    with pytest.raises(ConfigError, match="order must be one of"):
        PluginConfig.from_sources({"odma": {"order": "lifo"}}, env={})
    with pytest.raises(ConfigError, match="ODMA_VLLM_AGING_ROUNDS"):
        PluginConfig.from_sources({}, env={"ODMA_VLLM_AGING_ROUNDS": "soon"})
    with pytest.raises(ConfigError, match="aging_rounds"):
        PluginConfig.from_sources({"odma": {"aging_rounds": 0}}, env={})
    cfg = PluginConfig.from_sources({"odma": {"placement": "best-fit"}}, env={"ODMA_VLLM_MOVES": "0"})
    assert cfg.placement == "best-fit" and not cfg.moves
    with pytest.raises(ConfigError, match="placement must be one of"):
        PluginConfig.from_sources({"odma": {"placement": "first-fit"}}, env={})


# -- tags ------------------------------------------------------------------------------------------------


def test_user_text_is_the_last_user_turn_of_a_chat_prompt():
    chatml = ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
              "<|im_start|>assistant\n")
    assert user_text(chatml) == "What is 2+2?"
    assert user_text("plain completion prompt") == "plain completion prompt"



def test_length_tags_reserve_a_bucket_at_most_max_tokens_and_survive_a_failing_predictor():
    tags = LengthTags(LoadedPredictor(Answers([(100.0, 0.0), (float("nan"), 0.2), (5000.0, 0.1)]), "fixed", None),
                      max_tokens_cap=2048, generator="m")
    out = tags.tag(["a", "b", "c"], [10, 10, 10], [512, 64, 300], [0.0, 0.0, 0.0])
    assert out[0].predicted == 100.0 and 100 <= out[0].reserved_output <= 512
    assert out[1].predicted is None and out[1].reserved_output == 64  # NaN: sized for its max_tokens
    assert out[2].reserved_output == 300  # never above max_tokens
    assert remaining(out[0], 30) == 70.0 and remaining(out[1], 3) == math.inf
    failing = LengthTags(LoadedPredictor(Answers("fail"), "fixed", None), max_tokens_cap=2048, generator="m")
    assert [t.reserved_output for t in failing.tag(["x"], [4], [128], [1.0])] == [128]
    tags.observe(out[0], 130)
    s = tags.stats.as_dict()
    assert s["tagged"] == 2 and s["untagged"] == 1 and s["mean_abs_error"] == 30.0


def test_length_tags_follow_realized_lengths_through_the_running_median():
    median = RunningMedian(prior=128.0)
    tags = LengthTags(LoadedPredictor(median, median.name, "none"), max_tokens_cap=1024, generator="m")
    for n in (40, 40, 40):
        tags.observe(None, n)
    assert tags.tag(["q"], [8], [1024], [0.0])[0].predicted == 40.0


def test_the_plugin_queue_serves_in_the_engine_schedulers_order():
    """One order of service: the same waiting requests, ages and predictions give the same order through vLLM's
    queue interface as through the engine's `ShortestFirst` (random cases, aging and the adaptive depth included)."""
    import random

    from odma.engine.ordering import ShortestFirst

    rng = random.Random(7)
    for case in range(200):
        aging, depth = rng.choice((1, 2, 3, 50)), rng.choice((0, 0, 2, 5))
        q = ShortestFirstQueue(lambda r: r.predicted, aging_rounds=aging, depth=depth)
        engine_order = ShortestFirst(aging_rounds=aging, depth=depth)
        born = {}
        for rnd in range(rng.randint(1, 6)):
            for _ in range(rng.randint(0, 4)):
                r = _req(f"c{case}r{len(born)}", rng.choice((math.inf, *range(1, 40))))
                born[r] = q.round
                q.add_request(r)
            if q and rng.random() < 0.5:
                born.pop(q.pop_request())
            q.new_round()
        arrival = list(born)  # insertion order is arrival order
        expected = engine_order.rank(arrival, waited=lambda r: q.round - born[r], remaining=lambda r: r.predicted)
        assert [r.name for r in q] == [r.name for r in expected]
        if expected:
            assert q.pop_request() is expected[0]
