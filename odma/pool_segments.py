"""Ballooning hooks of the KV pool: extra segments, fences that drain a segment, relocation.

Mixed into `KVPool` (it shares the pool's lock and bookkeeping); used by `odma.balloon`. A pool that never
calls these behaves exactly as without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from odma.buckets import LARGE
from odma.errors import InvalidRequestError

if TYPE_CHECKING:
    from odma.allocator import Block
    from odma.policy import SizedRequest

MAIN = "main"


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
            self._fences[start_unit] = units
            for s, n in [(s, n) for s, n in self._regions[region].extents() if start_unit <= s < start_unit + units]:
                taken = self._regions[region].take(s, n)
                assert taken
                self._withheld[s] = n

    def unfence(self, start_unit: int) -> None:
        """Rollback of `fence`: the segment's withheld units become free again."""
        with self._lock:
            units, region = self._segment(start_unit)
            if self._fences.pop(start_unit, None) is None:
                return
            for s in [s for s in self._withheld if start_unit <= s < start_unit + units]:
                self._regions[region].free(s, self._withheld.pop(s))

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
        start, units = block.offset // self.align, block.capacity // self.align
        for f, n in self._fences.items():
            if f <= start < f + n:
                self._withheld[start] = units
                return True
        return False
