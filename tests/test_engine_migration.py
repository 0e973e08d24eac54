"""A request migrated to a larger block mid-decode produces exactly the tokens it produces unmigrated."""

from __future__ import annotations

import pytest
import torch

from odma.engine import SamplingParams
from odma.engine.testing import tiny_engine
from odma.models.tiny import make_tiny_model

torch.set_num_threads(2)
GREEDY = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(10, 50)), [100] * 17]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def folder(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("growth", ["next", "large", "double"])
def test_migrated_equals_unmigrated(folder, growth):
    from odma.config import PoolConfig

    static = tiny_engine(folder, policy="static")
    unmigrated = static.generate(PROMPTS, GREEDY)
    assert static.scheduler.counters.migrations == 0

    # L̂ = 1 puts every request in the smallest s3 bucket (16 tokens): it must migrate as it grows
    engine = tiny_engine(folder, policy="s3", predicted=1, pool=PoolConfig(align=4, growth=growth))
    migrated = engine.generate(PROMPTS, GREEDY)
    for a, b in zip(unmigrated, migrated):
        assert b.migrations >= 1
        assert a.output_ids == b.output_ids
    assert engine.pool.stats().migrations == engine.scheduler.counters.migrations >= len(PROMPTS)
    engine.pool.check_invariants()
    assert engine.pool.stats().live_blocks == 0


def test_migration_copies_the_live_kv(folder):
    """The block's first n tokens are bitwise equal after the move (what the model then reads)."""
    engine = tiny_engine(folder, policy="s3", predicted=1, align=4)
    seq = engine.add_request([1, 2, 3, 4], GREEDY)
    engine.step()  # prefill: the block holds the prompt
    for _ in range(GREEDY.max_tokens):
        block = seq.block
        before = engine.runner.arena.view(block)[:, :, : seq.num_cached].clone()
        engine.step()
        if seq.block != block:  # grown (in place: the K/V laid out again for the larger capacity) or moved
            break
    assert seq.block != block
    after = engine.runner.arena.view(seq.block)[:, :, : before.shape[2]]
    assert torch.equal(before, after)
    engine.abort(seq.request_id)
    engine.step()
    assert engine.pool.stats().live_blocks == 0


@pytest.mark.parametrize("hint", ["pred", "none"])
def test_the_first_growth_goes_straight_to_the_block_that_holds_the_prediction(folder, hint):
    """odma reserves for half of L̂; with the growth hint its first growth holds all of L̂ (one migration where
    bucket-by-bucket growth takes several), and the tokens are the same either way."""
    from odma.config import PoolConfig

    predicted, prompt = 100, [5, 6, 7]
    engine = tiny_engine(folder, predicted=predicted, pool=PoolConfig(align=4, growth_hint=hint))
    seq = engine.add_request(prompt, GREEDY)
    engine.step()  # tags and prefills
    assert seq.growth_hint == (predicted if hint == "pred" else None)
    first = seq.block
    assert first.capacity < len(prompt) + predicted  # reserve_scale 0.5
    while seq.block == first:
        engine.step()
    holds_prediction = seq.block.capacity >= len(prompt) + predicted
    assert holds_prediction == (hint == "pred")
    while not seq.finished:
        engine.step()
    reference = tiny_engine(folder, policy="static").generate([prompt], GREEDY)[0]
    assert seq.output_ids == reference.output_ids
    assert engine.pool.stats().live_blocks == 0


def test_samples_of_one_prompt_share_its_growth_hint(folder):
    from odma.config import PoolConfig

    engine = tiny_engine(folder, predicted=100, pool=PoolConfig(align=4, growth_hint="pred"))
    seqs = engine.add_samples([5, 6, 7], SamplingParams(max_tokens=20, temperature=0.8, seed=1), 3)
    while not all(s.finished for s in seqs):
        engine.step()
    assert [s.growth_hint for s in seqs] == [100, 100, 100]


def test_an_unknown_growth_hint_is_refused():
    from odma.config import PoolConfig
    from odma.errors import ConfigError

    with pytest.raises(ConfigError, match="growth_hint must be one of"):
        PoolConfig(growth_hint="cal")


def test_compaction_under_pressure_keeps_every_token(folder):
    """With --compact-growth on a pool too small for the batch, blocks moved out of a growing block's way (and the
    growth itself) leave every request's tokens as a roomy static run produces them."""
    from dataclasses import replace as with_fields

    from odma.config import PoolConfig

    prompts = [[3 + i, 4 + i, 5 + i] + list(range(10 + i, 10 + 7 * (i % 4))) for i in range(12)]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    reference = tiny_engine(folder, policy="static", kv_budget="8MiB").generate(prompts, params)
    engine = tiny_engine(folder, policy="s3", predicted=1, kv_budget="160KiB", preempt="wait",
                         pool=with_fields(PoolConfig(align=4), compact_growth=True))
    assert engine.workers[0].kv.compact_growth
    for a, b in zip(reference, engine.generate(prompts, params)):
        assert a.output_ids == b.output_ids
    kv = engine.workers[0].kv
    assert kv.compactions > 0 and engine.pool.stats().relocated_tokens > 0
    engine.pool.check_invariants()
    assert engine.pool.stats().live_blocks == 0


def test_packing_under_pressure_keeps_every_token(folder):
    """With packing on a pool too small for the batch, blocks slide over the gaps between them (their copies overlap
    their old places) and grow over the gaps beside them: every request's tokens stay as a roomy static run
    produces them."""
    import random

    from odma.config import PoolConfig

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(3, 40))] for _ in range(24)]
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    reference = tiny_engine(folder, policy="static", kv_budget="8MiB").generate(prompts, params)
    # L̂ = 1 reserves the first bucket (64 tokens) beyond each prompt: every request grows, 4 tokens at a time
    engine = tiny_engine(folder, policy="odma", predicted=1, kv_budget="384KiB", kv_growth="copy", packing=True,
                         pool=PoolConfig(align=4, growth_step=4))
    kv = engine.workers[0].kv
    assert kv.slide_growth and engine.pool.neighbour_growth
    for a, b in zip(reference, engine.generate(prompts, params)):
        assert a.output_ids == b.output_ids
    stats = engine.pool.stats()
    assert kv.slides > 0 and stats.grown_into_neighbours > 0 and stats.relocated_tokens > 0
    engine.pool.check_invariants()
    assert stats.live_blocks == 0
