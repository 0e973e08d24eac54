"""Shared prompt prefixes: a request whose prompt begins like a running request's cached tokens copies their K/V
and computes only the rest; outputs are those of a full prefill, and no block leaks."""

from __future__ import annotations

import random

import pytest
import torch

from odma.engine import SamplingParams
from odma.engine.prefix_share import PrefixIndex, shared_prefix
from odma.engine.testing import tiny_engine
from odma.models.tiny import make_tiny_model

torch.set_num_threads(1)
SYSTEM = list(range(100, 130))  # a 30-token "system prompt" every request starts with
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def _prompt(i: int, n: int = 12) -> list[int]:
    return SYSTEM + [200 + 7 * i + k for k in range(n)]


def _drain(engine):
    while engine.has_work():
        engine.step()


def _alone(folder, prompt):
    return tiny_engine(folder, prefix_share_min_tokens=0).generate([prompt], GREEDY)[0]


def test_a_later_request_copies_the_shared_prefix_and_generates_the_same(folder):
    engine = tiny_engine(folder)
    first = engine.add_request(_prompt(0), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    engine.step()  # the first prompt is prefilled; it decodes on
    before = engine.prefill_tokens
    second = engine.add_request(_prompt(1), GREEDY)
    _drain(engine)
    sched = engine.workers[0].scheduler
    assert sched.counters.prefix_copies == 1 and sched.counters.prefix_tokens == len(SYSTEM)
    assert engine.prefill_tokens - before == len(_prompt(1)) - len(SYSTEM)  # only the rest was computed
    alone = _alone(folder, _prompt(1))
    assert second.output_ids == alone.output_ids
    assert [e.logprob for e in second.output_logprobs] == pytest.approx([e.logprob for e in alone.output_logprobs],
                                                                         abs=1e-4)
    assert first.finished and engine.pool.stats().live_blocks == 0
    engine.pool.check_invariants()


def test_a_burst_computes_the_shared_prefix_once(folder):
    engine = tiny_engine(folder)
    prompts = [_prompt(i) for i in range(4)]
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    sched = engine.workers[0].scheduler
    assert engine.prefill_tokens == len(prompts[0])  # the others waited one step for its K/V
    assert sched.counters.prefix_holds == 3
    _drain(engine)
    assert sched.counters.prefix_copies == 3
    assert engine.prefill_tokens == len(prompts[0]) + sum(len(p) - len(SYSTEM) for p in prompts[1:])
    for prompt, seq in zip(prompts, seqs):
        assert seq.output_ids == _alone(folder, prompt).output_ids
    assert engine.pool.stats().live_blocks == 0
    engine.pool.check_invariants()


def test_a_prompt_that_is_all_shared_feeds_its_last_token(folder):
    engine = tiny_engine(folder)
    engine.add_request(_prompt(0, n=20), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    engine.step()
    short = _prompt(0, n=5)  # a prefix of the running prompt: every token but the last is copied
    seq = engine.add_request(short, GREEDY)
    _drain(engine)
    assert engine.workers[0].scheduler.counters.prefix_tokens == len(short) - 1
    assert seq.output_ids == _alone(folder, short).output_ids


def test_no_copy_from_a_finished_request_when_off_or_for_echo(folder):
    engine = tiny_engine(folder)
    engine.generate([_prompt(0)], GREEDY)  # finished: it holds nothing to copy from
    engine.generate([_prompt(1)], GREEDY)
    assert engine.workers[0].scheduler.counters.prefix_copies == 0

    off = tiny_engine(folder, prefix_share_min_tokens=0)
    off.add_request(_prompt(0), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    off.step()
    off.add_request(_prompt(1), GREEDY)
    _drain(off)
    assert off.workers[0].scheduler.counters.prefix_copies == 0

    engine = tiny_engine(folder)
    engine.add_request(_prompt(0), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    engine.step()
    scored = engine.add_request(_prompt(1), SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    _drain(engine)
    assert engine.workers[0].scheduler.counters.prefix_copies == 0  # echo scores every prompt position
    assert len(scored.prompt_logprobs) == len(_prompt(1))
    assert engine.pool.stats().live_blocks == 0


def test_a_preempted_holder_is_not_copied_from(folder):
    engine = tiny_engine(folder, preempt="recompute")
    holder = engine.add_request(_prompt(0), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    engine.step()
    sched = engine.workers[0].scheduler
    sched._preempt(holder)
    assert len(sched.prefixes) == 0
    engine.add_request(_prompt(1), GREEDY)
    _drain(engine)
    assert holder.finished and engine.pool.stats().live_blocks == 0
    engine.pool.check_invariants()


def test_the_index_finds_the_longest_shared_prefix():
    class Seq:
        def __init__(self, ids, cached):
            self.ids, self.num_cached, self.kv = ids, cached, object()  # it holds memory

        @property
        def num_tokens(self):
            return len(self.ids)

        def token_ids(self, a, b):
            return self.ids[a:b]

    index = PrefixIndex(min_tokens=4)
    a = Seq([1, 2, 3, 4, 5, 6, 7, 8], cached=8)
    b = Seq([1, 2, 3, 4, 5, 9, 9], cached=7)
    uncached = Seq([1, 2, 3, 4, 5, 6, 7, 8, 9], cached=2)  # its K/V are not in yet: only 2 tokens may be copied
    for s in (a, b, uncached):
        index.add(s)
    assert index.lookup(Seq([1, 2, 3, 4, 5, 6, 0], 0)) == (a, 6)
    assert index.lookup(Seq([1, 2, 3, 4, 5, 6, 7, 8], 0)) == (a, 7)  # never the last token
    assert index.lookup(Seq([1, 2, 3, 0, 5, 6, 7], 0)) == (None, 0)  # below min_tokens
    assert index.lookup(Seq([1, 2, 3], 0)) == (None, 0)
    index.remove(a)
    assert index.lookup(Seq([1, 2, 3, 4, 5, 6, 0], 0)) == (b, 5)
    for s in (b, uncached):
        index.remove(s)
    assert len(index) == 0
    with pytest.raises(ValueError):
        PrefixIndex(min_tokens=0)


def test_shared_prefix_matches_a_plain_scan():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randrange(0, 40)
        a = [rng.randrange(3) for _ in range(n)]
        b = a[: rng.randrange(0, n + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 10))]
        expected = 0
        while expected < min(len(a), len(b)) and a[expected] == b[expected]:
            expected += 1
        assert shared_prefix(a, b) == expected


def test_a_negative_minimum_is_refused():
    from odma.engine.config import EngineConfig
    from odma.errors import ConfigError

    with pytest.raises(ConfigError, match="prefix_share_min_tokens"):
        EngineConfig(prefix_share_min_tokens=-1)
    assert EngineConfig(prefix_share_min_tokens=0).prefix_share_min_tokens == 0


def test_no_request_waits_behind_a_long_prefill_for_a_prefix(folder):
    engine = tiny_engine(folder, kv_budget="4MiB", max_prefill_tokens=1024)  # both prompts fit one step's budget
    long_prompt = SYSTEM + [1 + k % 90 for k in range(300)]  # its step prefills more than HOLD_STEP_TOKENS: waiting one step costs too much
    seqs = [engine.add_request(long_prompt, GREEDY), engine.add_request(_prompt(1), GREEDY)]
    engine.step()
    sched = engine.workers[0].scheduler
    assert sched.counters.prefix_holds == 0
    assert engine.prefill_tokens == len(long_prompt) + len(_prompt(1))  # both prefilled in the first step
    _drain(engine)
    assert all(s.finished for s in seqs) and engine.pool.stats().live_blocks == 0


# -- read in place (prefix_reads): the prefix stays where the holder keeps it ------------------------------------

LONG = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def _reads(folder, **overrides):
    return tiny_engine(folder, prefix_reads=True, **overrides)


def test_a_shared_prefix_read_in_place_generates_the_same(folder):
    """A later request reads the holder's first rows in its block (the model's own attention on a CPU) and a third
    reads two pieces, the first from the holder's block after the holder ended (shrunk in place): the same tokens
    and logprobs as alone, only the rest computed, the pool empty at the end."""
    engine = _reads(folder)
    kv = engine.workers[0].kv
    first = engine.add_request(_prompt(0), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    engine.step()
    second = engine.add_request(_prompt(0, n=20), GREEDY)  # the first's prompt and 8 more tokens
    engine.step()
    assert first.finished and kv.parked == 1
    third = engine.add_request(_prompt(0, n=26), GREEDY)
    before = engine.prefill_tokens
    _drain(engine)
    sched = engine.workers[0].scheduler
    assert (sched.counters.prefix_maps, sched.counters.prefix_copies) == (2, 0)
    assert engine.prefill_tokens - before == 26 - 20  # the rest only
    for seq, n in ((second, 20), (third, 26)):
        alone = _alone(folder, _prompt(0, n=n))
        assert seq.output_ids == alone.output_ids
        assert [e.logprob for e in seq.output_logprobs] == pytest.approx(
            [e.logprob for e in alone.output_logprobs], abs=1e-4)
    assert engine.pool.stats().live_blocks == 0 and len(kv.shared) == 0
    engine.pool.check_invariants()


def test_a_holder_preempted_while_read_keeps_its_rows_and_comes_back(folder):
    engine = _reads(folder, preempt="recompute")
    kv = engine.workers[0].kv
    holder = engine.add_request(_prompt(0), LONG)
    engine.step()
    reader = engine.add_request(_prompt(1), GREEDY)
    engine.step()
    assert reader.kv.pieces[0][0] is holder.kv
    engine.workers[0].scheduler._preempt(holder)  # its rows stay for the reader, under an id of their own
    assert kv.parked == 1 and f"{holder.request_id}/read-1" in engine.pool
    _drain(engine)  # the holder comes back under its own id and finishes
    assert holder.output_ids == tiny_engine(folder, prefix_share_min_tokens=0).generate([_prompt(0)], LONG)[0].output_ids
    assert reader.output_ids == _alone(folder, _prompt(1)).output_ids
    assert engine.pool.stats().live_blocks == 0 and len(kv.shared) == 0
    engine.pool.check_invariants()


def test_a_reader_is_recomputed_not_swapped(folder):
    """Its block holds only its later rows: a swap would keep too few, so its preemption recomputes it."""
    engine = _reads(folder, preempt="swap")
    engine.add_request(_prompt(0), LONG)
    engine.step()
    reader = engine.add_request(_prompt(1), GREEDY)
    engine.step()
    sched = engine.workers[0].scheduler
    sched._preempt(reader)
    assert sched.counters.swap_outs == 0 and reader.num_cached == 0
    _drain(engine)
    assert reader.output_ids == _alone(folder, _prompt(1)).output_ids
    assert engine.pool.stats().live_blocks == 0
    engine.pool.check_invariants()


def test_samples_of_a_reader_copy_its_rows_from_every_piece(folder):
    """n > 1: the first sample reads the shared prefix in place; the others copy its prompt's rows from where they
    lie (the holder's block, then its own)."""
    engine = _reads(folder)
    engine.add_request(_prompt(0), LONG)
    engine.step()
    samples = engine.add_samples(_prompt(1), GREEDY, 3)
    _drain(engine)
    assert engine.forks.copied == 2 and engine.workers[0].scheduler.counters.prefix_maps == 1
    alone = _alone(folder, _prompt(1))
    assert all(s.output_ids == alone.output_ids for s in samples)
    assert engine.pool.stats().live_blocks == 0


def test_reading_in_place_needs_prefix_sharing_and_blocks_grown_by_copy(folder):
    from odma.errors import ConfigError

    with pytest.raises(ConfigError, match="prefix_share_min_tokens"):
        _reads(folder, prefix_share_min_tokens=0)
    with pytest.raises(ConfigError, match="grown by copy"):
        _reads(folder, kv_growth="map")
