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
