"""The engine through the Triton attention path (every request, one launch per kernel per layer) gives the tokens
the CPU path gives: greedy tokens equal on the tiny model, over contiguous blocks that migrate, swap and share
prefixes, and over the paged baseline's pages. On CPU the kernels run in Triton's interpreter (tests/conftest.py),
so these runs are short."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from backends import triton_attention  # noqa: E402
from odma.config import PoolConfig  # noqa: E402
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


def test_the_paged_baseline_maps_a_shared_prefix_s_whole_pages(folder):
    """Prompts that begin like a running request's map its full pages of them (16 tokens each) into their own page
    table and compute the rest: nothing copied, the same tokens as a full prefill, and the pages the holder gives
    back when it ends early stay with the requests that map them until they end too."""
    shared = [list(range(60, 96)) + [i] for i in range(3)]  # a 36-token prefix: two whole pages, four tokens over
    short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine = tiny_engine(folder, kv_budget="1MiB", attention="triton", policy="paged", device=DEVICE)
    kv = engine.workers[0].kv
    first = engine.add_request(shared[0], short)
    engine.step()  # its prompt is cached now
    its_pages = kv._pages[first.request_id][:2]
    before = engine.prefill_tokens
    later = [engine.add_request(p, GREEDY) for p in shared[1:]]
    engine.step()  # they map its pages, and it ends (its second token)
    assert first.finished and kv._pages[later[0].request_id][:2] == kv._pages[later[1].request_id][:2] == its_pages
    while engine.has_work():
        engine.step()
        kv.check()
    counters = engine.scheduler.counters
    assert (counters.prefix_maps, counters.prefix_copies, counters.prefix_tokens) == (2, 0, 64)
    assert engine.prefill_tokens - before == 2 * (len(shared[1]) - 32)
    alone = tiny_engine(folder, kv_budget="1MiB").generate(shared[1:], GREEDY)
    assert [s.output_ids for s in later] == [s.output_ids for s in alone]
    assert kv.free_pages == kv.total_pages


def test_blocks_continued_elsewhere_are_read_through_the_kernels(folder, reference):
    """pool.continue_growth: 16-token blocks that must grow, in a pool too small to migrate them all, go on in new
    blocks; the kernels read each request's earlier rows where they were left (pieces) and write its new rows into
    its new block. The same tokens as the CPU path with room for all; nothing left in the pool."""
    engine = tiny_engine(folder, kv_budget="32KiB", attention="triton", policy="s3", s3_buckets=16, predicted=1,
                         preempt="recompute", device=DEVICE, pool=PoolConfig(align=4, continue_growth=True))
    seqs = engine.generate(PROMPTS, GREEDY)
    kv = engine.workers[0].kv
    assert kv.continued > 0
    assert [s.output_ids for s in seqs] == reference
    stats = engine.pool.stats()
    assert stats.live_blocks == 0 and stats.reserved_tokens == 0 and len(kv.shared) == 0
    engine.pool.check_invariants()


def test_a_shared_prefix_is_read_in_place_through_the_kernels(folder):
    """prefix_reads: a request reads its first rows where the running holder keeps them; a third reads the first
    holder's rows and the second's (two pieces) after the first has ended (its block shrunk in place to the rows
    read). The same tokens as full prefills, only the rest computed, nothing left in the pool at the end."""
    base = list(range(60, 80))
    prompts = [base + [1], base + [1, 2, 3, 4, 5, 6, 7, 8], base + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    engine = tiny_engine(folder, kv_budget="1MiB", attention="triton", device=DEVICE, prefix_reads=True)
    kv = engine.workers[0].kv
    first = engine.add_request(prompts[0], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    engine.step()  # its prompt is cached
    second = engine.add_request(prompts[1], GREEDY)
    engine.step()  # the second reads its 21 first rows from the first's block; the first ends
    assert first.finished and kv.parked == 1 and second.kv.pieces[0][0].block is not None
    before = engine.prefill_tokens
    third = engine.add_request(prompts[2], GREEDY)
    engine.step()
    # rows 0..21 from the first's parked block, 21..28 from the second's: its own block holds the rest
    assert [(h.request_id, first_row, end) for h, first_row, end in third.kv.pieces] == [
        (f"{first.request_id}/read-1", 0, 21), (second.request_id, 21, 28)]
    while engine.has_work():
        engine.step()
        kv.check()
    counters = engine.scheduler.counters
    assert (counters.prefix_maps, counters.prefix_copies) == (2, 0)
    assert engine.prefill_tokens - before == len(prompts[2]) - len(prompts[1])  # the rest only
    alone = tiny_engine(folder, kv_budget="1MiB").generate(prompts, GREEDY)
    assert [s.output_ids for s in (second, third)] == [s.output_ids for s in alone[1:]]
    stats = engine.pool.stats()
    assert stats.live_blocks == 0 and stats.reserved_tokens == 0 and len(kv.shared) == 0


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


def _count_step(model, attention, batch: int, context: int = 9) -> tuple[int, int]:
    """(torch ops, Triton launches) of one decode step of `batch` requests through the Triton path."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from backends import KVLayout, get_backend
    from odma.models.llama import SeqSlot

    class Ops(TorchDispatchMode):
        n = 0
        in_launch = False  # what the interpreter does inside a launch is the kernel, not the step's torch ops

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.n += not Ops.in_launch
            return func(*args, **(kwargs or {}))

    c = model.config
    arena = get_backend(DEVICE).create_arena(batch * 16, KVLayout(c.num_layers, c.num_kv_heads, c.head_dim))
    from odma.kv import Block

    slots = [SeqSlot(arena.view(Block(16 * i, 16, 0)), context, 1) for i in range(batch)]
    launches = 0
    kernels = attention.kernels

    class Counting:  # stands in for the kernels module: counts every launch
        def __getattr__(self, name):
            kernel = getattr(kernels, name)

            class Launcher:
                def __getitem__(self, grid):
                    def launch(*a, **kw):
                        nonlocal launches
                        launches += 1
                        Ops.in_launch = True
                        try:
                            return kernel[grid](*a, **kw)
                        finally:
                            Ops.in_launch = False
                    return launch
            return Launcher()

    attention.kernels = Counting()
    try:
        with Ops():
            model(torch.arange(batch, device=DEVICE), torch.full((batch,), context, device=DEVICE), slots, attention)
    finally:
        attention.kernels = kernels
    return Ops.n, launches


def test_a_decode_step_is_a_fixed_number_of_ops_and_launches_whatever_the_batch(folder):
    """No loop over requests on the device path: 2 and 9 requests cost the same ops and kernel launches."""
    from backends.triton_attention import TritonAttention
    from odma.models import load_model

    model = load_model(folder, device=DEVICE)
    model.rotary.table(64)  # the runner makes the kernels' rotary table once, at start
    attention = TritonAttention(torch.device(DEVICE))
    _count_step(model, attention, 2)  # the first step allocates the page-locked staging buffer (on CUDA), once
    small, large = _count_step(model, attention, 2), _count_step(model, attention, 9)
    assert small == large  # torch ops (norms, GEMMs, rotary, casts, views) and launches: none per request
    # the K/V write (which also rotates q and k) and the decode attention of each layer (one split at this
    # context: no reduction)
    assert small[1] == 2 * model.config.num_layers
