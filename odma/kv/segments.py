"""Ballooning state of a KV pool: extra address ranges (segments), fences that drain a range, the units withheld
inside fences, and the search for the emptiest window of a range. Range bookkeeping only (no live blocks, no
torch): the pool owns one `SegmentMap` over its free extents and calls it.

A fence withholds a range's free units and every block given back inside it, so the range only empties.
A segment is fenced to be returned to the device; a window is fenced so that a large request gets one
contiguous range without waiting for every block in the pool to end: the blocks inside it are relocated
elsewhere (into lent segments, say) instead of waited for.
"""

from __future__ import annotations

from odma.errors import InvalidRequestError
from odma.kv.blocks import Block
from odma.kv.extents import ExtentMap


class SegmentMap:
    def __init__(self, regions: dict[str, ExtentMap], base_units: int) -> None:
        self.regions = regions  # the pool's free extents per region (the same objects)
        self.base_units = base_units  # the pool's own address range [0, base_units)
        self.segments: dict[int, tuple[int, str]] = {}  # start unit → (units, region)
        self.fences: dict[int, int] = {}  # start unit → units of a range being drained
        self.withheld: dict[int, int] = {}  # start unit → units neither free nor live (inside fences)

    def units(self, region: str | None = None) -> int:
        """Units of every segment (of `region`)."""
        return sum(n for n, r in self.segments.values() if region in (None, r))

    def withheld_units(self) -> int:
        return sum(self.withheld.values())

    def open_ranges(self, region: str | None) -> list[int]:
        """Units of each segment of `region` (or any) that is not being drained."""
        return [n for s, (n, r) in self.segments.items() if s not in self.fences and region in (None, r)]

    def add(self, start_unit: int, units: int, region: str) -> None:
        """A new range of `region`'s free space; it must neither overlap nor touch the address space, so no
        block ever spans two segments."""
        if region not in self.regions or units < 1 or start_unit < 0:
            raise InvalidRequestError(f"bad segment {start_unit}+{units} in region {region!r}")
        ranges = [(0, self.base_units)] + [(s, n) for s, (n, _) in self.segments.items()]
        if any(start_unit <= s + n and s <= start_unit + units for s, n in ranges):
            raise InvalidRequestError(f"segment {start_unit}+{units} overlaps or touches the address space")
        self.segments[start_unit] = (units, region)
        self.regions[region].add_range(start_unit, units)

    def segment(self, start_unit: int) -> tuple[int, str]:
        seg = self.segments.get(start_unit)
        if seg is None:
            raise InvalidRequestError(f"no segment starts at unit {start_unit}")
        return seg

    def segment_of(self, start: int, units: int, region: str) -> int | None:
        """The segment of `region` holding [start, start + units), if any."""
        for s, (n, r) in self.segments.items():
            if r == region and s <= start and start + units <= s + n:
                return s
        return None

    def remove(self, start_unit: int) -> int:
        """Drop a fenced segment whose units are all withheld (no live block left); returns its units."""
        units, _ = self.segment(start_unit)
        if start_unit not in self.fences:
            raise InvalidRequestError(f"segment at unit {start_unit} is not fenced")
        inside = [s for s in self.withheld if start_unit <= s < start_unit + units]
        held = sum(self.withheld[s] for s in inside)
        if held != units:
            raise InvalidRequestError(f"segment at unit {start_unit} still holds {units - held} units in use")
        for s in inside:
            del self.withheld[s]
        del self.fences[start_unit], self.segments[start_unit]
        return units

    def fence(self, start: int, units: int, region: str) -> None:
        """Withhold the free units of `region` inside [start, start + units) and, from now on, every block given
        back there (`withhold_if_fenced`)."""
        self.fences[start] = units
        for s, n in list(self.regions[region].extents()):
            lo, hi = max(s, start), min(s + n, start + units)
            if lo < hi:
                taken = self.regions[region].take(lo, hi - lo)
                assert taken
                self.withheld[lo] = hi - lo

    def lift(self, start: int, units: int, region: str) -> None:
        """Undo `fence`: the range's withheld units become free units of `region` again."""
        del self.fences[start]
        for s in [s for s in self.withheld if start <= s < start + units]:
            self.regions[region].free(s, self.withheld.pop(s))

    def withhold_if_fenced(self, block: Block, align: int) -> bool:
        """Withhold the part of a given-back block inside a fence and free the rest (a block can straddle a
        window's edge). False: no fence touches it."""
        start, end = block.offset // align, block.end // align
        pos = start
        for lo, hi in sorted((max(start, f), min(end, f + n)) for f, n in self.fences.items() if f < end and start < f + n):
            if pos < lo:
                self.regions[block.region].free(pos, lo - pos)
            self.withheld[lo] = hi - lo
            pos = hi
        if pos == start:
            return False
        if pos < end:
            self.regions[block.region].free(pos, end - pos)
        return True

    def check(self) -> None:
        for s, n in self.withheld.items():
            assert any(f <= s and s + n <= f + m for f, m in self.fences.items()), f"withheld {s}+{n} unfenced"

