"""KV ↔ activation ballooning in the engine: idle activation room is lent to the KV pool as segments and
taken back (live blocks migrate out) before a prefill needs it. Tokens never change, nothing leaks, and
lent bytes + the running prefill's activation peak never exceed the reserve."""

from __future__ import annotations

import pytest
import torch

from odma.engine import SamplingParams
from odma.engine.testing import tiny_engine
from odma.models.tiny import make_tiny_model

torch.set_num_threads(2)
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
SHORT = [list(range(3 + i, 13 + i)) for i in range(8)]  # 8 prompts of 10 tokens
LONG = list(range(20, 80))  # one 60-token prompt: its prefill needs (almost) the whole activation reserve


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def reference(folder):
    engine = tiny_engine(folder, kv_budget="1MiB")
    return [s.output_ids for s in engine.generate(SHORT + [LONG], GREEDY)]


def _engine(folder, balloon: bool, preempt: str = "wait", **overrides):
    # 64 KiB at 512 B/token = 128 slots; the reserve for a 64-token prefill is ~180 KiB of activations
    return tiny_engine(folder, kv_budget="64KiB", align=4, max_prefill_tokens=64, balloon=balloon,
                       balloon_segment_tokens=64, balloon_keep_tokens=8, preempt=preempt, **overrides)


def _run(engine, prompts, *, late: list | None = None, after: int = 0):
    """Step to completion; `late` prompts arrive after `after` steps. Checks invariants every step."""
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    scheduled = engine.scheduler.schedule
    step_prefill = [0]

    def schedule():
        work = scheduled()
        step_prefill[0] = sum(w.q_len for w in work if w.q_len > 1)
        if engine.elastic is not None:
            engine.elastic.check(step_prefill[0])
        return work

    engine.scheduler.schedule = schedule
    peak = steps = 0
    while engine.has_work() or (late and steps <= after):
        if late and steps == after:
            seqs += [engine.add_request(p, GREEDY) for p in late]
        engine.step()
        steps += 1
        peak = max(peak, engine.num_running)
        engine.pool.check_invariants()
        if engine.elastic is not None:
            engine.elastic.check(step_prefill[0])
    return seqs, peak


def test_ballooning_raises_concurrency_and_keeps_tokens(folder, reference):
    off_seqs, off_peak = _run(_engine(folder, False), SHORT)
    engine = _engine(folder, True)
    on_seqs, on_peak = _run(engine, SHORT)
    assert [s.output_ids for s in on_seqs] == [s.output_ids for s in off_seqs] == reference[:len(SHORT)]
    assert on_peak > off_peak  # the lent segments held more requests at once
    assert engine.elastic.counters.lends > 0
    stats = engine.pool.stats()
    assert stats.live_blocks == 0 and stats.reserved_tokens == 0


@pytest.mark.parametrize("preempt", ["wait", "recompute"])
def test_a_long_prefill_takes_its_room_back(folder, reference, preempt):
    engine = _engine(folder, True, preempt, balloon_chunked_prefill=False)  # the prefill waits for its whole room
    seqs, _ = _run(engine, SHORT, late=[LONG], after=6)
    assert [s.output_ids for s in seqs] == reference  # blocks moved out of segments arrive intact
    e = engine.elastic
    assert e.counters.lends > 0 and e.balloon.metrics.deflations > 0
    assert e.balloon.metrics.moved_blocks > 0  # live blocks were evacuated from a segment mid-decode
    assert e.counters.lends < 20  # lent room is not taken back and re-lent every step
    assert engine.pool.stats().live_blocks == 0
    assert all(s.finish_reason == "length" for s in seqs)


@pytest.mark.parametrize("preempt", ["wait", "recompute"])
def test_a_long_prompt_is_prefilled_in_chunks_of_the_free_room(folder, reference, preempt):
    engine = _engine(folder, True, preempt, balloon_chunked_prefill=True, clear_window=True)
    seqs, _ = _run(engine, SHORT, late=[LONG], after=6)
    assert [s.output_ids for s in seqs] == reference  # chunks attend to the K/V of the chunks before them
    c = engine.scheduler.counters
    assert c.prefill_chunks > 0 and c.activation_refusals == 0  # no prefill waited for lent room
    assert engine.pool.stats().live_blocks == 0
    assert all(s.finish_reason == "length" for s in seqs)


def test_nothing_lent_when_no_request_waits(folder):
    engine = _engine(folder, True)
    _run(engine, SHORT[:1])
    assert engine.elastic.counters.lends == 0 and engine.elastic.lent_bytes == 0
