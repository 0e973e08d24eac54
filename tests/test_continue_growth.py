"""A block that cannot grow where it lies goes on in a new one (PoolConfig.continue_growth): its rows so far stay where
they are, under an id of their own, and the request reads them there as a piece (odma.kv.shared_rows), as a shared
prefix read in place is read. Nothing is copied; the rows left behind are freed with their last reader."""

from __future__ import annotations

import pytest
import torch
from test_kv_packing import RecordingMover

from odma.config import PoolConfig
from odma.engine import SamplingParams
from odma.engine.testing import tiny_engine
from odma.errors import ConfigError, DuplicateRequestError, InvalidRequestError
from odma.kv import ContiguousKV, ExactPolicy, KVHandle, KVPool, KVRequest
from odma.kv.manager import CONTINUED_PIECES
from odma.kv.shared_rows import SharedRows
from odma.models.tiny import make_tiny_model

torch.set_num_threads(1)
UNIT = 16


def _pool(units: int, mover=None) -> KVPool:
    return KVPool(units * UNIT, ExactPolicy(), align=UNIT, large_share=0.0, mover=mover, worst_case_prompt_share=1.0)


def _boxed_in(mover=None) -> KVPool:
    """A (two full units) before B; two single free units apart, after B and after C: A cannot grow in place, and no
    free range holds its grown block (three units)."""
    pool = _pool(7, mover)
    for rid, units in (("A", 2), ("B", 1), ("x", 1), ("C", 1), ("y", 1), ("D", 1)):
        assert pool.reserve(_request(rid, units)) is not None
    for rid in ("x", "y"):
        pool.release(rid, 0, observe=False)
    pool.flush_free_lists()
    assert pool.extend("A", 2 * UNIT) is not None  # A's block full
    return pool


def _request(rid: str, units: int, max_new: int = 64) -> KVRequest:
    """A request whose block is `units` units: its prompt fills all but 8 tokens, 8 are reserved output."""
    return KVRequest(rid, units * UNIT - 8, max_new, predicted_tokens=8)


def test_a_block_that_cannot_grow_goes_on_in_a_new_block_and_nothing_is_copied():
    mover = RecordingMover()
    pool = _boxed_in(mover)
    a = pool.handle_of("A")
    old = pool.block_of("A")
    assert pool.extend("A", 2 * UNIT + 1) is None  # no range holds three units
    new = pool.continue_elsewhere("A", 2 * UNIT + 1, as_id="A/rows-1")
    assert new is not None and new.capacity == UNIT and new.offset != old.offset
    assert mover.copies == []  # nothing copied: the rows stay where they are
    assert pool.block_of("A/rows-1") == old and pool.length_of("A/rows-1") == 2 * UNIT
    assert pool.handle_of("A") is a and a.block == new  # the request's handle stays its own, on the new block
    assert pool.handle_of("A/rows-1") is not a
    assert pool.length_of("A") == 1  # the new block holds the rows from 32 on
    assert pool.extend("A", UNIT) == new  # and grows as any block does, its lengths counted from its first row
    pool.check_invariants()
    pool.release("A", 0)
    pool.release("A/rows-1", 0, observe=False)
    pool.check_invariants()
    assert pool.stats().live_blocks == 3 and pool.stats().continued == 1  # B, C and D


def test_continuing_without_room_or_with_a_wrong_length_or_id_changes_nothing():
    pool = _boxed_in()
    assert pool.reserve(_request("E", 1)) and pool.reserve(_request("F", 1))  # the last free units
    block = pool.block_of("A")
    assert pool.continue_elsewhere("A", 2 * UNIT + 1, as_id="A/rows-1") is None  # no free unit left
    for bad in (2 * UNIT, 2 * UNIT + 57, 40.0, True):
        with pytest.raises(InvalidRequestError, match="new length"):
            pool.continue_elsewhere("A", bad, as_id="A/rows-1")
    with pytest.raises(DuplicateRequestError):
        pool.continue_elsewhere("A", 2 * UNIT + 1, as_id="B")
    assert pool.block_of("A") == block and "A/rows-1" not in pool and pool.length_of("A") == 2 * UNIT
    pool.check_invariants()


def test_readers_of_a_continued_block_read_its_rows_where_they_were_left():
    rows = SharedRows()
    holder, reader, left = KVHandle("h", 64), KVHandle("r", 64), KVHandle("h/rows-1", 64)
    prefix = KVHandle("p", 64)
    rows.add(holder, [(prefix, 0, 16)])  # the holder reads 16 rows elsewhere, its block holds rows from 16
    rows.add(reader, rows.pieces_for(holder, 40))  # the reader reads 16 of them there and 24 in the holder's block
    rows.continued(holder, left, 30)  # the holder's 30 rows (16..46) stay in `left`; it goes on from row 46
    assert holder.pieces == [(prefix, 0, 16), (left, 16, 46)] and holder.first_row == 46
    assert reader.pieces == [(prefix, 0, 16), (left, 16, 40)]  # re-pointed: the rows are in `left` now
    assert rows.rows_to_keep(holder) is None and left in rows.parked
    assert rows.drop(holder) == []  # the reader still reads `left`
    assert rows.drop(reader) == [left]  # its last reader gone: freed


def _kv(pool: KVPool, **kw) -> ContiguousKV:
    return ContiguousKV(pool, continue_growth=True, **kw)


def test_the_manager_continues_before_it_compacts_and_frees_the_rows_with_the_request():
    pool = _boxed_in()
    kv = _kv(pool, compact_growth=True, slide_growth=True)
    growth = kv.grow("A", 2 * UNIT + 1)
    assert growth is not None and growth.copied_tokens == 0 and not growth.moved
    assert kv.continued == 1 and kv.compactions == kv.slides == 0 and pool.relocated_tokens == 0
    a = pool.handle_of("A")
    assert [(h.request_id, first, end) for h, first, end in a.pieces] == [("A/rows-1", 0, 2 * UNIT)]
    assert kv.grow("A", 3 * UNIT) is not None and pool.length_of("A") == UNIT  # rows 32..48 in its own block
    kv.release("A", 16)
    assert "A/rows-1" not in pool and "A" not in pool and len(kv.shared) == 0
    assert kv.counters()["continued"] == 1
    pool.check_invariants()


def test_a_request_reads_at_most_so_many_pieces_then_grows_as_before():
    """Single free units between one-unit walls: the block can only ever go on in the next gap, until it reads
    CONTINUED_PIECES pieces; then it grows as before (here: no room, it waits), and its rows go with it."""
    gaps = CONTINUED_PIECES + 2
    pool = _pool(1 + 2 * gaps)
    kv = _kv(pool)
    assert pool.reserve(_request("A", 1, max_new=200)) is not None
    for i in range(gaps):
        assert pool.reserve(_request(f"wall{i}", 1)) and pool.reserve(_request(f"gap{i}", 1))
    for i in range(gaps):
        pool.release(f"gap{i}", 0, observe=False)
    pool.flush_free_lists()
    handle = pool.handle_of("A")
    for _ in range(CONTINUED_PIECES):
        end = handle.first_row + handle.capacity
        assert kv.grow("A", end) is not None  # fill the block
        assert kv.grow("A", end + 1) is not None and pool.stats().migrations == 0
    assert kv.continued == len(handle.pieces) == CONTINUED_PIECES and handle.first_row == CONTINUED_PIECES * UNIT
    block = pool.block_of("A")
    assert kv.grow("A", handle.first_row + UNIT) is not None
    assert kv.grow("A", handle.first_row + UNIT + 1) is None and pool.block_of("A") == block  # a free unit is left
    kv.evict("A")  # preempted: the rows it left go with it
    assert not any(r.startswith("A") for r in pool.live_requests()) and len(kv.shared) == 0
    pool.check_invariants()


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 6, 7], list(range(10, 40)), [100] * 17, [3], list(range(200, 222))]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def _continuing(folder, **overrides):
    """Blocks of 16 tokens (s3 buckets) that must grow to hold 12 outputs, in a pool too small to migrate them all."""
    return tiny_engine(folder, kv_budget="32KiB", policy="s3", s3_buckets=16, predicted=1, preempt="recompute",
                       pool=PoolConfig(align=4, continue_growth=True), **overrides)


def test_continued_requests_generate_the_same_tokens_and_logprobs(folder):
    """On a CPU a request reading pieces runs the model's own attention: tokens and logprobs equal the runs with
    room for every block, and the pool is empty at the end."""
    reference = tiny_engine(folder, kv_budget="1MiB").generate(PROMPTS, GREEDY)
    engine = _continuing(folder)
    seqs = engine.generate(PROMPTS, GREEDY)
    kv = engine.workers[0].kv
    assert kv.continued > 0 and engine.stats().pool_counter("continued") == kv.continued  # what /metrics reports
    assert [s.output_ids for s in seqs] == [s.output_ids for s in reference]
    for seq, ref in zip(seqs, reference):
        assert [e.logprob for e in seq.output_logprobs] == pytest.approx(
            [e.logprob for e in ref.output_logprobs], abs=1e-4)
    stats = engine.pool.stats()
    assert stats.live_blocks == 0 and stats.reserved_tokens == 0 and len(kv.shared) == 0
    engine.pool.check_invariants()


def test_continuing_with_shared_prefixes_read_in_place(folder):
    """Readers of a shared prefix whose holders go on in new blocks: the same tokens, nothing left behind."""
    system = list(range(60, 90))
    prompts = [system + [1 + i, 2 + i] for i in range(4)]
    reference = tiny_engine(folder, kv_budget="1MiB").generate(prompts, GREEDY)
    engine = _continuing(folder, prefix_reads=True)
    seqs = engine.generate(prompts, GREEDY)
    kv = engine.workers[0].kv
    assert kv.continued > 0 and engine.scheduler.counters.prefix_maps > 0
    assert [s.output_ids for s in seqs] == [s.output_ids for s in reference]
    assert engine.pool.stats().live_blocks == 0 and len(kv.shared) == 0
    engine.pool.check_invariants()


def test_continuing_needs_blocks_grown_by_copy(folder):
    with pytest.raises(ConfigError, match="continue_growth"):
        tiny_engine(folder, kv_growth="map", pool=PoolConfig(continue_growth=True))
