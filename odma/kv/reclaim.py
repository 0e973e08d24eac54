"""Taking a range back from the live blocks in it: window clearing. A request that holds the queue but finds no
contiguous range gets one without waiting for every block in the pool to end: the range it would need where the
fewest live tokens sit is fenced and the blocks inside are relocated elsewhere (into lent segments, say), largest
first. A running request whose block cannot grow for the same reason gets its range the same way (compaction:
copies instead of a preemption), and when no window's blocks have anywhere else to go, blocks slide over the gaps
between them until the gaps make one range (sliding: a partial compaction). Built on the pool's primitives (fence a
range, relocate or slide a block) under its lock; ballooning's deflation, which drains a lent segment the same way,
is `odma.kv.balloon`.
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


def slide_for_growth(pool: KVPool, request_id: str, new_len: int) -> tuple[int, bool]:
    """Make room for the growth of `request_id` to `new_len` tokens by sliding blocks over the gaps between them (a
    partial compaction), the cheapest way (`cheapest_slides`): a run of neighbouring blocks is packed so that its
    gaps become one free range, either right after the growing block (it then grows in place, so only its growth
    must fit) or anywhere (the whole grown block must fit; it migrates there). Unlike `clear_for_growth`, which
    needs somewhere else for every block of a window, this finds room whenever the pool's free units hold the
    growth and the block has gaps on either side. Returns (blocks slid, cleared)."""
    with pool.lock:
        need = pool.growth_units(request_id, new_len)
        if need is None:
            return 0, False
        units, large = need
        extra = units - pool.block_of(request_id).capacity // pool.align  # what in-place growth needs after it
        return _slide(pool, units, large, request_id, extra)


def _slide(pool: KVPool, units: int, large: bool, own: str | None, extra: int) -> tuple[int, bool]:
    if pool.ranges.segments or pool.ranges.fences or pool.free_units < extra:
        return 0, False
    pool.flush_free_lists()  # cached blocks rejoin the extents: they are gaps too
    best = None
    align, spans = pool.align, pool.live_spans()  # read once, not once a region and a block
    for lo, size, region in pool.base_ranges(large):
        first, end = lo * align, (lo + size) * align
        blocks = [(block.offset // align, block.capacity // align, rid, length) for rid, block, length in spans
                  if block.region == region and first <= block.offset < end]
        found = cheapest_slides(blocks, pool.free_extents(region), units, own, extra)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    if best is None:
        return 0, False
    moved = 0
    for rid, offset in best[1]:
        if pool.slide(rid, offset * pool.align) is None:
            return moved, False
        moved += 1
    return moved, True


def cheapest_slides(blocks: Sequence[tuple[int, int, str, int]], gaps: Sequence[tuple[int, int]], units: int,
                    own: str | None, extra: int) -> tuple[tuple[int, int], list[tuple[str, int]]] | None:
    """((live tokens, blocks) moved, [(request id, new offset unit)] in the order to move them) of the cheapest way
    to gather room by sliding blocks of one region (`blocks`: (offset unit, units, request id, live tokens);
    `gaps`: its free (start unit, units)). Three shapes of run: from a gap to a gap, packed down (to its front) so
    that its gaps add up to `units` at its end; from a gap to `own`, packed down, so that its gaps and the one right
    after `own` add up to `extra` right after `own` (which moves too); from right after `own` to a gap, packed up
    (to its end), so that `extra` lies right after `own` (which stays). None when no run has room enough. Of runs
    that cost the same, the first found wins: the gap-to-gap run starting lowest, then a run down to `own`, then
    one up from it (which moves `own` least: on a tie with the runs before, it wins).

    O(n log n) in the region's blocks and gaps (the sort; the rest is linear with bisections): a run's cost and
    room are differences of prefix sums, and the runs worth trying are the shortest with room enough from each
    gap, whose far end only moves forward as the near one does."""
    items: list[tuple[int, int, str | None, int]] = sorted([*blocks, *((s, n, None, 0) for s, n in gaps)])
    gap_at = [i for i, item in enumerate(items) if item[2] is None]
    # tokens[i], count[i]: live tokens and blocks among items[:i]; room[p]: units of the gaps before gap p
    tokens = list(accumulate((item[3] for item in items), initial=0))
    count = list(accumulate((item[2] is not None for item in items), initial=0))
    room = list(accumulate((items[i][1] for i in gap_at), initial=0))

    def cost(a: int, b: int) -> tuple[int, int]:  # of the blocks among items[a:b]
        return tokens[b] - tokens[a], count[b] - count[a]

    best: tuple[tuple[int, int], int, int, str] | None = None  # (cost, first item, last item, packed down or up)
    for p, a in enumerate(gap_at):  # from gap a to the first gap b after which the run holds `units`: room anywhere
        q = bisect.bisect_left(room, room[p] + units, lo=p + 1) - 1
        if q == len(gap_at):
            break  # nor from any later gap: the gaps from there on hold less
        b = gap_at[q]
        if best is None or cost(a, b) < best[0]:
            best = (cost(a, b), a, b, "down")
    k = None if own is None else next((i for i, item in enumerate(items) if item[2] == own), None)
    if k is not None:
        after = items[k + 1][1] if k + 1 < len(items) and items[k + 1][2] is None else 0
        before = bisect.bisect_left(gap_at, k)  # gaps before own: gap_at[:before]
        # from the nearest gap below own whose run holds `extra` with the gap after own, packed down
        p = bisect.bisect_right(room, room[before] + after - extra, 0, before) - 1
        if p >= 0:
            a = gap_at[p]
            run = (items[k][3] + cost(a, k)[0], 1 + cost(a, k)[1])
            if best is None or run < best[0]:
                best = (run, a, k, "down")
        # from right after own to the first gap above it whose run holds `extra`, packed up (on a tie: own stays)
        q = bisect.bisect_left(room, room[before] + extra, lo=before + 1) - 1
        if q < len(gap_at):
            b = gap_at[q]
            if best is None or cost(k + 1, b) <= best[0]:
                best = (cost(k + 1, b), k + 1, b, "up")
    if best is None:
        return None
    run, a, b, direction = best
    moves = []
    if direction == "down":
        cursor = items[a][0]
        for offset, size, rid, _ in items[a:b + 1]:
            if rid is not None:
                if cursor != offset:
                    moves.append((rid, cursor))
                cursor += size
    else:
        cursor = items[b][0] + items[b][1]
        for offset, size, rid, _ in reversed(items[a:b + 1]):
            if rid is not None:
                cursor -= size
                if cursor != offset:
                    moves.append((rid, cursor))
    return run, moves


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
