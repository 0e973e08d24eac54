"""The engine through the Triton attention path (every request, one launch per kernel per layer) gives the tokens
the CPU path gives: greedy tokens equal on the tiny model, over contiguous blocks that migrate, swap and share
prefixes, and over the paged baseline's pages. On CPU the kernels run in Triton's interpreter (tests/conftest.py),
so these runs are short."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from backends import triton_attention  # noqa: E402
from odma.engine import SamplingParams  # noqa: E402
from odma.engine.testing import tiny_engine  # noqa: E402
from odma.errors import ConfigError  # noqa: E402
from odma.models.tiny import make_tiny_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not triton_attention.interpreting() else "cpu"
pytestmark = pytest.mark.skipif(triton_attention.available(torch.device(DEVICE)) is not None,
                                reason="Triton cannot run here")

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(10, 40)), [100] * 17, [3], list(range(200, 222))]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def folder(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def reference(folder):
    """The CPU path (C decode kernel + SDPA prefills), nothing under pressure."""
    return [s.output_ids for s in tiny_engine(folder, kv_budget="1MiB").generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("policy", ["odma", "paged"])
def test_greedy_tokens_equal_the_cpu_path(folder, reference, policy):
    engine = tiny_engine(folder, kv_budget="1MiB", attention="triton", policy=policy, device=DEVICE)
    assert type(engine.runner.attention).__name__ == "TritonAttention"
    seqs = engine.generate(PROMPTS, GREEDY)
    assert [s.output_ids for s in seqs] == reference
    stats = engine.pool.stats()
    assert stats.live_blocks == 0 and stats.reserved_tokens == 0
    engine.workers[0].kv.check()


def test_migrations_and_swaps_keep_the_tokens(folder, reference):
    """A pool too small for the batch, buckets smaller than the outputs (8-token s3 buckets, 12 tokens out: blocks
    migrate) and swap preemption: the K/V the kernels read after a move or a swap-in are the right ones."""
    engine = tiny_engine(folder, kv_budget="32KiB", attention="triton", policy="s3", s3_buckets=16, predicted=1,
                         preempt="swap", align=4, device=DEVICE)
    seqs = engine.generate(PROMPTS, GREEDY)
    counters, stats = engine.scheduler.counters, engine.pool.stats()
    assert stats.migrations > 0 and counters.preemptions > 0 and counters.swap_ins > 0
    assert [s.output_ids for s in seqs] == reference
    engine.pool.check_invariants()


def test_a_copied_prefix_is_read_by_the_prefill_kernel(folder):
    """Prompts that begin like a running request's copy its cached K/V and prefill the rest from there (a chunk
    whose keys start before its first query)."""
    shared = [list(range(60, 80)) + [i] for i in range(3)]  # a 20-token prefix
    engine = tiny_engine(folder, kv_budget="1MiB", attention="triton", device=DEVICE)
    first = engine.add_request(shared[0], GREEDY)
    engine.step()  # its prompt is cached now
    later = [engine.add_request(p, GREEDY) for p in shared[1:]]
    while engine.has_work():
        engine.step()
    assert engine.scheduler.counters.prefix_copies == 2
    alone = tiny_engine(folder, kv_budget="1MiB").generate(shared, GREEDY)
    assert [s.output_ids for s in [first, *later]] == [s.output_ids for s in alone]


def test_paged_baseline_recomputes_under_pressure(folder, reference):
    engine = tiny_engine(folder, kv_budget="32KiB", attention="triton", policy="paged", device=DEVICE)
    seqs = engine.generate(PROMPTS, GREEDY)
    assert engine.scheduler.counters.preemptions > 0
    assert [s.output_ids for s in seqs] == reference
    engine.workers[0].kv.check()
    assert engine.workers[0].kv.free_pages == engine.workers[0].kv.total_pages


def test_sampled_tokens_and_logprobs_match_the_cpu_path(folder):
    """Rows that sample or report logprobs go through the host sampler, the greedy ones stay argmax: a mixed batch."""
    params = [SamplingParams(max_tokens=8, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, min_tokens=8)]
    prompts = PROMPTS[:3]

    def run(**kw):
        engine = tiny_engine(folder, kv_budget="1MiB", **kw)
        seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        while engine.has_work():
            engine.step()
        return seqs

    cpu, tri = run(), run(attention="triton", device=DEVICE)
    assert [s.output_ids for s in tri] == [s.output_ids for s in cpu]
    for a, b in zip(tri[1].output_logprobs, cpu[1].output_logprobs):
        assert a.token == b.token and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_paged_needs_the_triton_attention(folder):
    with pytest.raises(ConfigError, match="Triton"):
        tiny_engine(folder, policy="paged", attention="sdpa")
    with pytest.raises(ConfigError, match="ballooning"):
        tiny_engine(folder, policy="paged", balloon=True)
