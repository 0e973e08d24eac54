"""Ballooning hooks of the KV pool: extra segments, fences that drain a range, relocation.

Mixed into `KVPool` (it shares the pool's lock and bookkeeping); used by `odma.balloon` (segments) and the
scheduler (the window of a request that holds the queue). A pool that never calls these behaves exactly as
without them.

A fence withholds a range's free units and every block given back inside it, so the range only empties.
A segment is fenced to be returned to the device; a window is fenced so that a large request gets one
contiguous range without waiting for every block in the pool to end: the blocks inside it are relocated
elsewhere (into lent segments, say) instead of waited for.
"""

from __future__ import annotations

import bisect
from itertools import accumulate
from typing import TYPE_CHECKING

from odma.buckets import LARGE
from odma.errors import InvalidRequestError
from odma.policy import validate_request

if TYPE_CHECKING:
    from odma.allocator import Block
    from odma.policy import SizedRequest

MAIN, LARGE_REGION = "main", "large"


class SegmentHooks:

    @property
    def capacity_tokens(self) -> int:
        """Token slots the pool can hand out now: the initial range plus segments, less withheld units."""
        with self._lock:
            units = self._units + sum(n for n, _ in self._segments.values()) - sum(self._withheld.values())
            return units * self.align

    def segments(self) -> dict[int, tuple[int, str]]:
        """start unit → (units, region) of every segment added with `add_segment`."""
        with self._lock:
            return dict(self._segments)

    def add_segment(self, start_unit: int, units: int, region: str = MAIN) -> None:
        """Add [start_unit, start_unit + units) (in allocation units) as free space of `region`. It must
        neither overlap nor touch the address space, so no block ever spans two segments."""
        with self._lock:
            if region not in self._regions or units < 1 or start_unit < 0:
                raise InvalidRequestError(f"bad segment {start_unit}+{units} in region {region!r}")
            ranges = [(0, self._units)] + [(s, n) for s, (n, _) in self._segments.items()]
            if any(start_unit <= s + n and s <= start_unit + units for s, n in ranges):
                raise InvalidRequestError(f"segment {start_unit}+{units} overlaps or touches the address space")
            self._segments[start_unit] = (units, region)
            self._regions[region].add_range(start_unit, units)

    def fence(self, start_unit: int) -> None:
        """Start draining a segment: its free units and any block given back inside it are withheld (never
        handed out again) until `unfence` (rollback) or `remove_segment`."""
        with self._lock:
            units, region = self._segment(start_unit)
            if start_unit in self._fences:
                return
            self._flush()  # cached blocks inside the segment must not be handed out
            self._fence_range(start_unit, units, region)

    def unfence(self, start_unit: int) -> None:
        """Rollback of `fence`: the segment's withheld units become free again."""
        with self._lock:
            units, region = self._segment(start_unit)
            if start_unit in self._fences:
                self._lift_fence(start_unit, units, region)

    def live_in(self, start_unit: int, units: int) -> list[str]:
        """Requests whose block lies in [start_unit, start_unit + units)."""
        lo, hi = start_unit * self.align, (start_unit + units) * self.align
        with self._lock:
            return [rid for rid, live in self._live.items() if lo <= live.block.offset < hi]

    def relocate(self, req: SizedRequest | str) -> Block | None:
        """Migrate a live block to a new block of the same capacity and bucket elsewhere (through the
        mover, then the swap); the old block is given back (withheld if fenced). None = no room."""
        with self._lock:
            live = self._lookup(req)
            old = live.block
            units = old.capacity // self.align
            new = self._carve(units, old.bucket, prefer_large=old.bucket == LARGE, allow_large=True)
            if new is None:
                return None
            if self.mover is not None:
                try:
                    self.mover.copy(old, new, live.length)
                except BaseException:
                    self._give_back(new)
                    raise
            live.block = new
            self._recycle(old)
            return new

    def remove_segment(self, start_unit: int) -> int:
        """Drop a fenced segment whose units are all withheld (no live block left); returns its tokens."""
        with self._lock:
            units, _ = self._segment(start_unit)
            if start_unit not in self._fences:
                raise InvalidRequestError(f"segment at unit {start_unit} is not fenced")
            inside = [s for s in self._withheld if start_unit <= s < start_unit + units]
            held = sum(self._withheld[s] for s in inside)
            if held != units:
                raise InvalidRequestError(f"segment at unit {start_unit} still holds {units - held} units in use")
            for s in inside:
                del self._withheld[s]
            del self._fences[start_unit], self._segments[start_unit]
            return units * self.align

    # -- the window of a request that holds the queue ----------------------------------------------------

    def clear_window(self, req: SizedRequest) -> tuple[int, bool]:
        """Make room for `reserve(req)` by moving blocks instead of waiting for them to end: take the range it
        would need where the fewest live tokens sit and, if the free space outside could hold that range's
        blocks, relocate them (largest first) with the range fenced, so none lands back inside. Returns
        (blocks moved, cleared); cleared means the range is free now for the reserve that follows. When a
        block finds no room (fragmentation), the blocks moved so far stay valid where they went."""
        validate_request(req)
        with self._lock:
            if self._units_for(req.prompt_tokens + req.max_new_tokens) > self._largest_range_units():
                return 0, False  # reserve() refuses it as too large: nothing to make room for
            res = self._initial(req)
            units = self._units_for(req.prompt_tokens + res.output_tokens)
            large = res.bucket == LARGE or units > self._largest_range_units(MAIN)
            # The window's blocks must fit in the free space outside it, so the pool needs `units` free in
            # all: checked first, because a held head asks every round while memory stays full.
            if sum(r.free_units for r in self._regions.values()) + self._free.units < units:
                return 0, False
            best = None
            for lo, size, region in self._ranges((MAIN, LARGE_REGION) if large else (MAIN,)):
                found = self._emptiest_window(lo, size, units)
                if found is not None and (best is None or found[0] < best[0]):
                    best = (*found, region)
            if best is None:
                return 0, False
            _, start, inside, region = best
            self._flush()  # cached blocks become free extents (and none inside the range is handed out)
            self._fence_range(start, units, region)
            moved = 0
            try:
                # after fencing, the free units counted are those outside the window
                if sum(live.block.capacity for live in inside) // self.align <= sum(r.free_units for r in self._regions.values()):
                    for live in sorted(inside, key=lambda l: -l.block.capacity):
                        if self.relocate(live.request.request_id) is None:
                            break
                        moved += 1
            finally:  # the range's withheld units (those freed by the moves too) are free again
                self._lift_fence(start, units, region)
            return moved, moved == len(inside)

    def _ranges(self, regions: tuple[str, ...]) -> list[tuple[int, int, str]]:
        """The base address range (start unit, units, region) of each of `regions`. Segments are never
        windows: they are small, and they are lent to be taken back."""
        base = {MAIN: (0, self._main_units), LARGE_REGION: (self._main_units, self._large_units)}
        return [(*base[r], r) for r in regions if base[r][1] > 0]

    def _emptiest_window(self, lo: int, size: int, units: int) -> tuple[tuple[int, int], int, list] | None:
        """((live tokens, blocks), start, live blocks inside) of the `units` window in [lo, lo + size) that
        holds the fewest live tokens, or None. Such a window starts or ends at a range end or a block edge;
        blocks never overlap, so sorted by offset their ends are sorted too, and the blocks a window overlaps
        are one run of them (found by bisection, their tokens summed by prefix sums)."""
        if units > size:
            return None
        a = self.align
        lives = sorted((l for l in self._live.values() if lo * a <= l.block.offset < (lo + size) * a),
                       key=lambda l: l.block.offset)
        offsets = [l.block.offset for l in lives]
        ends = [l.block.end for l in lives]
        tokens = list(accumulate((l.length for l in lives), initial=0))
        edges = {lo, lo + size} | {o // a for o in offsets} | {e // a for e in ends}
        best = None
        for start in sorted({min(max(lo, x - d), lo + size - units) for x in edges for d in (0, units)}):
            i = bisect.bisect_right(ends, start * a)  # first block ending after the window starts
            j = bisect.bisect_left(offsets, (start + units) * a)  # first block starting after it ends
            cost = (tokens[j] - tokens[i], j - i)
            if best is None or cost < best[0]:
                best = (cost, start, lives[i:j])
        return best

    def _fence_range(self, start: int, units: int, region: str) -> None:
        """Withhold the free units of `region` inside [start, start + units) and, from now on, every block given
        back there (`_withhold_if_fenced`)."""
        self._fences[start] = units
        for s, n in list(self._regions[region].extents()):
            lo, hi = max(s, start), min(s + n, start + units)
            if lo < hi:
                taken = self._regions[region].take(lo, hi - lo)
                assert taken
                self._withheld[lo] = hi - lo

    def _lift_fence(self, start: int, units: int, region: str) -> None:
        """Undo `_fence_range`: the range's withheld units become free units of `region` again."""
        del self._fences[start]
        for s in [s for s in self._withheld if start <= s < start + units]:
            self._regions[region].free(s, self._withheld.pop(s))

    def _segment(self, start_unit: int) -> tuple[int, str]:
        seg = self._segments.get(start_unit)
        if seg is None:
            raise InvalidRequestError(f"no segment starts at unit {start_unit}")
        return seg

    def _segment_of(self, start: int, units: int, region: str) -> int | None:
        for s, (n, r) in self._segments.items():
            if r == region and s <= start and start + units <= s + n:
                return s
        return None

    def _withhold_if_fenced(self, block: Block) -> bool:
        """Withhold the part of a given-back block inside a fence and free the rest (a block can straddle a
        window's edge). False: no fence touches it."""
        start, end = block.offset // self.align, block.end // self.align
        pos = start
        for lo, hi in sorted((max(start, f), min(end, f + n)) for f, n in self._fences.items() if f < end and start < f + n):
            if pos < lo:
                self._regions[block.region].free(pos, lo - pos)
            self._withheld[lo] = hi - lo
            pos = hi
        if pos == start:
            return False
        if pos < end:
            self._regions[block.region].free(pos, end - pos)
        return True
