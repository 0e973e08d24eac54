"""Packing odma's blocks under memory pressure (EngineConfig.packing): blocks slide over the gaps between them
(KVPool.slide, odma.kv.reclaim.slide_for_growth), grow over the gaps beside them (PoolConfig.neighbour_growth), grow
by a few tokens (growth "step"), and the engine turns it on where block copies are cheap (accelerators)."""

from __future__ import annotations

import pytest

from odma.config import PoolConfig
from odma.engine.config import PACKED_THETA, EngineConfig
from odma.errors import ConfigError, InvalidRequestError
from odma.kv import BucketManager, BucketPolicy, ContiguousKV, ExactPolicy, KVPool, KVRequest, Reservation
from odma.kv.reclaim import cheapest_slides, clear_for_growth

UNIT = 16


class RecordingMover:
    def __init__(self) -> None:
        self.copies = []

    def copy(self, src, dst, n_tokens) -> None:
        self.copies.append((src, dst, n_tokens))


def _layout(spec: str, *, neighbour_growth: bool = False, mover=None) -> KVPool:
    """A pool laid out as `spec`, one letter per 16-token unit: a capital letter is a unit of that request's block
    (its prompt fills all but 8 tokens, 8 are reserved output), "." a free unit."""
    pool = KVPool(len(spec) * UNIT, ExactPolicy(), align=UNIT, large_share=0.0, neighbour_growth=neighbour_growth,
                  mover=mover, worst_case_prompt_share=1.0)
    runs: list[tuple[str, int]] = []
    for ch in spec:
        if runs and runs[-1][0] == ch and ch != ".":
            runs[-1] = (ch, runs[-1][1] + 1)
        else:
            runs.append((ch, 1))
    for i, (name, units) in enumerate(runs):
        rid = name if name != "." else f"gap{i}"
        assert pool.reserve(KVRequest(rid, units * UNIT - 8, 40, predicted_tokens=8)) is not None
    for i, (name, _) in enumerate(runs):
        if name == ".":
            pool.release(f"gap{i}", 0, observe=False)
    pool.flush_free_lists()
    assert pool.block_of(runs[-1][0] if runs[-1][0] != "." else runs[-2][0]) is not None
    pool.check_invariants()
    return pool


def _offsets(pool: KVPool, *rids: str) -> list[int]:
    return [pool.block_of(r).offset // UNIT for r in rids]


def test_a_block_slides_down_and_up_over_a_gap_smaller_than_itself():
    pool = _layout("A.BBB.C")
    assert pool.slide("B", 1 * UNIT).offset == UNIT  # down over the gap before it: the copy overlaps
    assert _offsets(pool, "A", "B", "C") == [0, 1, 6] and pool.free_extents("main") == [(4, 2)]
    assert pool.slide("B", 3 * UNIT).offset == 3 * UNIT  # and up again, over both gaps
    assert pool.free_extents("main") == [(1, 2)]
    s = pool.stats()
    assert s.relocations == 2 and s.relocated_tokens == 2 * (3 * UNIT - 8)
    assert s.overlapped_tokens == s.relocated_tokens  # both moves overlapped B's old place
    pool.check_invariants()


def test_a_slide_over_memory_that_is_not_free_is_refused_and_changes_nothing():
    pool = _layout("ABB.C")
    assert pool.slide("A", 1 * UNIT) is None  # B lies there
    assert pool.slide("C", 2 * UNIT) is None  # B's tail lies there (only the unit after B is free)
    assert _offsets(pool, "A", "B", "C") == [0, 1, 4]
    with pytest.raises(InvalidRequestError):
        pool.slide("B", 8)  # not a multiple of the pool's unit
    pool.check_invariants()


def test_growth_that_no_window_can_make_room_for_slides_the_next_block_up():
    # A must grow by a unit; B follows it; the only free units are one before A and one after B: a window of A's
    # grown size has nowhere to send its blocks (2 units free in all), but B can slide up over the unit after it
    kv = ContiguousKV(_layout(".AAABBB.CC"), compact_growth=True, slide_growth=True)
    grown = 3 * UNIT - 8 + 9  # past A's capacity of 48
    assert clear_for_growth(kv.pool, "A", grown) == (0, False)
    growth = kv.grow("A", grown)
    assert growth is not None and growth.capacity == 4 * UNIT and not growth.moved  # grown in place
    assert _offsets(kv.pool, "A", "B", "C") == [1, 5, 8] and kv.slides == 1
    assert kv.relocated_tokens == 3 * UNIT - 8  # B's tokens, copied once
    kv.pool.check_invariants()


def test_growth_slides_its_own_block_down_when_the_room_lies_before_it():
    # B must grow by 2 units: one is free before it, one after, and C has no gap after it to slide into
    kv = ContiguousKV(_layout("AA.BBB.CCC"), compact_growth=True, slide_growth=True)
    b_len = 3 * UNIT - 8
    growth = kv.grow("B", b_len + 8 + 17)  # 2 units more than its 48
    assert growth is not None and growth.capacity == 5 * UNIT
    assert _offsets(kv.pool, "A", "B", "C") == [0, 2, 7] and kv.slides == 1
    kv.pool.check_invariants()


def test_without_sliding_the_same_growth_is_refused():
    kv = ContiguousKV(_layout(".AAABBB.CC"), compact_growth=True)
    assert kv.grow("A", 3 * UNIT - 8 + 9) is None
    assert _offsets(kv.pool, "A", "B", "C") == [1, 4, 8]


def test_sliding_never_makes_room_that_is_not_there():
    kv = ContiguousKV(_layout("AAA.BBBB"), compact_growth=True, slide_growth=True)
    assert kv.grow("A", 3 * UNIT - 8 + 8 + 17) is None  # 2 units more, 1 free
    assert kv.slides == 0 and kv.relocated_tokens == 0
    kv.pool.check_invariants()


def test_the_cheapest_run_is_chosen():
    # (offset unit, units, id, live tokens); gaps (start, units): growing "x" by 1 unit can slide the small
    # block after it up (10 tokens) or itself down (500): the small one moves
    blocks = [(1, 4, "x", 500), (5, 1, "small", 10)]
    cost, moves = cheapest_slides(blocks, [(0, 1), (6, 1)], units=5, own="x", extra=1)
    assert moves == [("small", 6)] and cost == (10, 1)
    blocks = [(1, 4, "x", 10), (5, 1, "big", 500)]
    cost, moves = cheapest_slides(blocks, [(0, 1), (6, 1)], units=5, own="x", extra=1)
    assert moves == [("x", 0)] and cost == (10, 1)
    assert cheapest_slides(blocks, [(0, 1)], units=5, own="x", extra=2) is None


def test_a_block_grows_over_the_gaps_on_both_sides_in_one_copy():
    mover = RecordingMover()
    pool = _layout("AA.BBB.CCC", neighbour_growth=True, mover=mover)
    length = 3 * UNIT - 8
    grown = pool.extend("B", length + 8 + 17)  # 2 units more: the unit before it and the one after
    assert grown is not None and (grown.offset, grown.capacity) == (2 * UNIT, 5 * UNIT)
    src, dst, n = mover.copies[-1]
    assert (src.offset, src.capacity, dst.offset, dst.capacity, n) == (3 * UNIT, 3 * UNIT, 2 * UNIT, 5 * UNIT, length)
    s = pool.stats()
    assert s.grown_into_neighbours == 1 and s.migrations == 1 and s.free_tokens == 0
    assert s.overlapped_tokens == length  # through a temporary: a cost model charges it twice
    pool.check_invariants()


def test_without_neighbour_growth_the_gaps_beside_a_block_are_not_used():
    pool = _layout("AA.BBB.CCC")
    assert pool.extend("B", 3 * UNIT - 8 + 8 + 17) is None
    assert pool.stats().grown_into_neighbours == 0


def test_a_failed_copy_into_the_neighbours_gives_their_units_back():
    class Failing:
        def copy(self, src, dst, n_tokens):
            raise RuntimeError("device error")

    pool = _layout("AA.BBB.CCC", neighbour_growth=True, mover=Failing())
    with pytest.raises(RuntimeError):
        pool.extend("B", 3 * UNIT - 8 + 8 + 17)
    assert pool.block_of("B").offset == 3 * UNIT and pool.free_extents("main") == [(2, 1), (6, 1)]
    pool.check_invariants()


def test_growth_by_a_step_reserves_a_few_tokens_beyond_the_need():
    policy = BucketPolicy(BucketManager.fixed((64, 512), 1024), growth="step", growth_step=32)
    req = KVRequest("r", 100, 1024, predicted_tokens=10.0)
    assert policy.grow(req, 70, Reservation(64, 0)) == Reservation(102, 0)
    assert policy.grow(req, 1000, Reservation(64, 0)).output_tokens == 1024  # never past max_new_tokens
    with pytest.raises(ConfigError):
        BucketPolicy(BucketManager.fixed((64,), 1024), growth="step", growth_step=0)
    with pytest.raises(ConfigError):
        PoolConfig(growth="step", growth_step=-1)


def test_packing_is_the_default_where_block_copies_are_cheap():
    gpu = EngineConfig(device="cuda")
    assert gpu.capabilities.cheap_block_copies and gpu.packing_resolved
    pool = gpu.resolved_pool
    assert pool.compact_growth and pool.slide_growth and pool.neighbour_growth and pool.growth == "step"
    assert gpu.resolved_admission_theta == PACKED_THETA < 1
    assert EngineConfig(device="cuda", admission_theta=0.8).resolved_admission_theta == 0.8  # a lower θ stays
    cpu = EngineConfig(device="cpu")
    assert not cpu.packing_resolved and cpu.resolved_pool == cpu.pool and cpu.resolved_admission_theta == 1.0
    assert EngineConfig(device="cpu", packing=True).resolved_pool.slide_growth  # asked for, on a CPU too
    assert not EngineConfig(device="cuda", packing=False).packing_resolved
    assert not EngineConfig(device="cuda", policy="static").packing_resolved  # only odma's blocks grow


def test_the_scheduler_gets_packings_theta():
    from odma.analyze.profiles import SMOLLM2_CONFIG
    from odma.models.config import ModelConfig

    model = ModelConfig.from_hf_dict(SMOLLM2_CONFIG)
    assert EngineConfig(device="cuda").scheduler_config(model).admission_theta == PACKED_THETA
    assert EngineConfig(device="cpu").scheduler_config(model).admission_theta == 1.0


def test_a_slide_over_a_gap_as_large_as_the_block_is_a_plain_copy():
    pool = _layout("AA..BB")
    assert pool.slide("B", 2 * UNIT) is not None  # B's new place ends where its old one begins
    s = pool.stats()
    assert s.relocated_tokens == 2 * UNIT - 8 and s.overlapped_tokens == 0


def test_an_ended_request_keeps_its_first_rows_in_place_and_frees_its_tail():
    """KVPool.keep_front: the block of a request that ended while others read its first rows shrinks where it is
    (its rows re-laid for the smaller capacity by one copy), the tail is free at once, and the rows stay live
    (they can still slide) until released."""
    mover = RecordingMover()
    pool = _layout("A.BBB.C", mover=mover)
    before = pool.reserved_tokens
    kept = pool.keep_front("B", 20)
    assert (kept.offset, kept.capacity) == (2 * UNIT, 2 * UNIT)  # 20 rows: two units, at the same place
    assert mover.copies[-1][1:] == (kept, 20) and mover.copies[-1][0].capacity == 3 * UNIT
    assert pool.free_extents("main") == [(1, 1), (4, 2)]  # the tail joined the gap after it
    assert pool.reserved_tokens == before - UNIT and pool.length_of("B") == 20
    pool.check_invariants()
    assert pool.slide("B", UNIT).offset == UNIT  # compaction may still move it
    assert pool.free_extents("main") == [(3, 3)]
    pool.release("B", 0, observe=False)
    pool.flush_free_lists()
    assert pool.free_extents("main") == [(1, 5)]
    pool.check_invariants()


@pytest.mark.parametrize("rows", [0, 3 * UNIT, 2.5, True])
def test_keeping_rows_the_block_does_not_hold_is_refused_and_changes_nothing(rows):
    pool = _layout("A.BBB.C")
    block, length = pool.block_of("B"), pool.length_of("B")
    with pytest.raises(InvalidRequestError, match="rows to keep"):
        pool.keep_front("B", rows)
    assert pool.block_of("B") == block and pool.length_of("B") == length
    pool.check_invariants()
