"""Free extents of one address range: O(1) allocate / free with coalescing (TLSF-style segregated fit).

Sizes are in allocation units (the pool's alignment). Free extents sit in size-class bins (8 classes per
power of two); a bitmap finds the first non-empty class that surely fits, so both operations are O(1)
whatever the number of extents. Neighbours coalesce on free through start/end maps.
"""

from __future__ import annotations

from typing import Iterator

_SL = 3  # 2**_SL classes per power of two
_SUB = 1 << _SL


def size_class(size: int) -> int:
    """Class index, non-decreasing in size; every size in class c is >= class_floor(c)."""
    fl = size.bit_length() - 1
    if fl < _SL + 1:
        return size
    return (fl - _SL) * _SUB + (size >> (fl - _SL))


def class_floor(c: int) -> int:
    if c < 2 * _SUB:
        return c
    fl = c // _SUB + _SL - 1
    return (c % _SUB + _SUB) << (fl - _SL)


# Hot-path tables for sizes below _TABLE units (blocks are rarely larger): the class of a size, and the
# first class whose every extent fits it.
_TABLE = 1 << 12
_CLASS_OF = [size_class(n) for n in range(_TABLE)]
_FIT_CLASS = [c if class_floor(c) >= n else c + 1 for n, c in enumerate(_CLASS_OF)]


class ExtentMap:
    """Free extents inside ranges added with `add_range`; callers guarantee they never free twice."""

    def __init__(self) -> None:
        self._by_start: dict[int, int] = {}  # start → size
        self._by_end: dict[int, int] = {}  # end (exclusive) → start
        self._bins: dict[int, dict[int, None]] = {}  # class → starts (an ordered set)
        self._bitmap = 0
        self.free_units = 0

    # -- bins --------------------------------------------------------------------------------------

    def _insert(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        c = _CLASS_OF[size] if size < _TABLE else size_class(size)
        b = self._bins.get(c)
        if b is None:
            b = self._bins[c] = {}
        b[start] = None
        self._bitmap |= 1 << c

    def _remove(self, start: int, size: int) -> None:
        del self._by_start[start]
        del self._by_end[start + size]
        c = _CLASS_OF[size] if size < _TABLE else size_class(size)
        b = self._bins[c]
        del b[start]
        if not b:
            self._bitmap &= ~(1 << c)

    # -- public ------------------------------------------------------------------------------------

    def add_range(self, start: int, size: int) -> None:
        """Make [start, start+size) free (a new segment, or a block given back)."""
        if size > 0:
            self.free(start, size)

    def allocate(self, size: int) -> int | None:
        """Start of a `size`-unit range carved from the front of a fitting extent, or None."""
        if size <= 0 or size > self.free_units:
            return None
        if size < _TABLE:
            c = _FIT_CLASS[size]
        else:
            c = size_class(size)
            if class_floor(c) < size:
                c += 1  # every extent in class c+1 or above fits
        m = self._bitmap >> c
        if m:
            c += (m & -m).bit_length() - 1
            start = next(iter(self._bins[c]))
            extent = self._by_start[start]
        else:
            # Only the request's own class may still hold a fit: scan it (rare, under pressure).
            start = -1
            for s in self._bins.get(size_class(size), ()):
                if self._by_start[s] >= size:
                    start = s
                    break
            if start < 0:
                return None
            extent = self._by_start[start]
        self._remove(start, extent)
        if extent > size:
            self._insert(start + size, extent - size)
        self.free_units -= size
        return start

    def free(self, start: int, size: int) -> None:
        end = start + size
        prev_start = self._by_end.get(start)
        if prev_start is not None:
            self._remove(prev_start, start - prev_start)
            start = prev_start
        next_size = self._by_start.get(end)
        if next_size is not None:
            self._remove(end, next_size)
            end += next_size
        self._insert(start, end - start)
        self.free_units += size

    def take_front(self, start: int, size: int) -> bool:
        """Remove [start, start+size) if a free extent starts at `start` and holds it (O(1): growing a block
        into the free units right after it)."""
        n = self._by_start.get(start)
        if n is None or n < size or size <= 0:
            return False
        self._remove(start, n)
        if n > size:
            self._insert(start + size, n - size)
        self.free_units -= size
        return True

    def start_of_extent_ending_at(self, end: int) -> int | None:
        """Start of the free extent that ends at `end` (exclusive), or None (O(1): the free units right before a block)."""
        return self._by_end.get(end)

    def size_at(self, start: int) -> int:
        """Size of the free extent that begins at `start` (0 when none does)."""
        return self._by_start.get(start, 0)

    def take(self, start: int, size: int) -> bool:
        """Remove exactly [start, start+size) if it lies inside one free extent (for shrinking a pool)."""
        for s, n in self._by_start.items():
            if s <= start and start + size <= s + n:
                self.carve(s, start, size)
                return True
        return False

    def carve(self, extent_start: int, start: int, size: int) -> None:
        """Remove [start, start+size) from the free extent that begins at `extent_start` (O(1); it must hold it)."""
        n = self._by_start[extent_start]
        if not (extent_start <= start and start + size <= extent_start + n and size > 0):
            raise ValueError(f"[{start}, {start + size}) is not inside the free extent at {extent_start} of {n}")
        self._remove(extent_start, n)
        if start > extent_start:
            self._insert(extent_start, start - extent_start)
        if extent_start + n > start + size:
            self._insert(start + size, extent_start + n - start - size)
        self.free_units -= size

    def largest_extent(self) -> tuple[int, int] | None:
        """(start, size) of the largest free extent, the lowest start among equals; None when nothing is free."""
        if not self._bitmap:
            return None
        c = self._bitmap.bit_length() - 1
        return max(((s, self._by_start[s]) for s in self._bins[c]), key=lambda e: (e[1], -e[0]))

    def largest(self) -> int:
        if not self._bitmap:
            return 0
        c = self._bitmap.bit_length() - 1
        return max(self._by_start[s] for s in self._bins[c])

    def extents(self) -> Iterator[tuple[int, int]]:
        return iter(sorted(self._by_start.items()))

    def __len__(self) -> int:
        return len(self._by_start)

    def check(self) -> None:
        """Internal consistency (tests): maps agree, bins and bitmap agree, neighbours coalesced."""
        assert len(self._by_start) == len(self._by_end)
        total = 0
        for s, n in self._by_start.items():
            assert n > 0 and self._by_end[s + n] == s
            assert s in self._bins[size_class(n)]
            assert (s + n) not in self._by_start, f"uncoalesced neighbours at {s + n}"
            total += n
        assert total == self.free_units, (total, self.free_units)
        for c, b in self._bins.items():
            assert bool(b) == bool(self._bitmap >> c & 1)
            for s in b:
                assert size_class(self._by_start[s]) == c
