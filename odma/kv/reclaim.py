"""Taking a range back from the live blocks in it: window clearing. A request that holds the queue but finds no
contiguous range gets one without waiting for every block in the pool to end: the range it would need where the
fewest live tokens sit is fenced and the blocks inside are relocated elsewhere (into lent segments, say), largest
first. A running request whose block cannot grow for the same reason gets its range the same way (compaction:
copies instead of a preemption). Built on the pool's primitives (fence a range, relocate a block) under its lock; ballooning's deflation,
which drains a lent segment the same way, is `odma.kv.balloon`.
"""

from __future__ import annotations

import bisect
from itertools import accumulate
from typing import TYPE_CHECKING, Sequence

from odma.kv.blocks import Block

if TYPE_CHECKING:
    from odma.kv.policy import SizedRequest
    from odma.kv.pool import KVPool


def clear_window(pool: KVPool, req: SizedRequest) -> tuple[int, bool]:
    """Make room for `pool.reserve(req)` by moving blocks instead of waiting for them to end. Returns (blocks
    moved, cleared); cleared means the range is free now for the reserve that follows. When a block finds no room
    (fragmentation), the blocks moved so far stay valid where they went."""
    with pool.lock:
        need = pool.reservation_units(req)
        if need is None:
            return 0, False  # reserve() refuses it as too large: nothing to make room for
        units, large = need
        return _clear(pool, units, large, pool.live_spans())


def clear_for_growth(pool: KVPool, request_id: str, new_len: int) -> tuple[int, bool]:
    """Make room for the block that `pool.extend(request_id, new_len)` migrates to when no free range holds it but
    the pool's free units do (fragmentation, not capacity): the range with the fewest live tokens is cleared as
    `clear_window` clears one. The growing block itself is never moved (it is copied once, by the growth), so a
    range over it is chosen only when no other exists, and then nothing is cleared. Returns (blocks moved,
    cleared); cleared means the `extend` that follows finds room."""
    with pool.lock:
        need = pool.growth_units(request_id, new_len)
        if need is None:
            return 0, False
        units, large = need
        own = pool.total_tokens + 1  # more live tokens than any range holds: a window over it is the last choice
        spans = [(rid, block, own if rid == request_id else length) for rid, block, length in pool.live_spans()]
        return _clear(pool, units, large, spans, keep=request_id)


def _clear(pool: KVPool, units: int, large: bool, lives: list[tuple[str, Block, int]],
           keep: str | None = None) -> tuple[int, bool]:
    """Clear the `units` range (in the large region too when `large`) with the fewest live tokens among `lives`
    (request id, block, tokens) by relocating its blocks elsewhere; never the block of `keep`."""
    # The window's blocks must fit in the free space outside it, so the pool needs `units` free in all:
    # checked first, because a held head asks every round while memory stays full.
    if pool.free_units < units:
        return 0, False
    spans = [(block, length) for _, block, length in lives]
    best = None
    for lo, size, region in pool.base_ranges(large):
        found = emptiest_window(spans, lo, size, units, pool.align)
        if found is not None and (best is None or found[0] < best[0]):
            best = (*found, region)
    if best is None:
        return 0, False
    _, start, inside, region = best
    inside = [lives[i] for i in inside]
    if any(rid == keep for rid, _, _ in inside):
        return 0, False
    pool.fence_range(start, units, region)
    moved = 0
    try:
        # after fencing, the free units counted are those outside the window
        if sum(block.capacity for _, block, _ in inside) // pool.align <= pool.free_units:
            for rid, _, _ in sorted(inside, key=lambda live: -live[1].capacity):
                if pool.relocate(rid) is None:
                    break
                moved += 1
    finally:  # the range's withheld units (those freed by the moves too) are free again
        pool.lift_range(start, units, region)
    return moved, moved == len(inside)


def emptiest_window(blocks: Sequence[tuple[Block, int]], lo: int, size: int, units: int,
                    align: int) -> tuple[tuple[int, int], int, list[int]] | None:
    """((live tokens, blocks), start unit, indexes into `blocks` inside) of the `units` window in [lo, lo + size)
    that holds the fewest live tokens, or None. `blocks` are (block, live tokens) pairs. Such a window starts or
    ends at a range end or a block edge; blocks never overlap, so sorted by offset their ends are sorted too,
    and the blocks a window overlaps are one run of them (found by bisection, their tokens summed by prefix
    sums)."""
    if units > size:
        return None
    a = align
    order = sorted((i for i, (b, _) in enumerate(blocks) if lo * a <= b.offset < (lo + size) * a),
                   key=lambda i: blocks[i][0].offset)
    offsets = [blocks[i][0].offset for i in order]
    ends = [blocks[i][0].end for i in order]
    tokens = list(accumulate((blocks[i][1] for i in order), initial=0))
    edges = {lo, lo + size} | {o // a for o in offsets} | {e // a for e in ends}
    best = None
    for start in sorted({min(max(lo, x - d), lo + size - units) for x in edges for d in (0, units)}):
        i = bisect.bisect_right(ends, start * a)  # first block ending after the window starts
        j = bisect.bisect_left(offsets, (start + units) * a)  # first block starting after it ends
        cost = (tokens[j] - tokens[i], j - i)
        if best is None or cost < best[0]:
            best = (cost, start, order[i:j])
    return best
