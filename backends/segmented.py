"""Several arenas behind one token address space: the device side of a ballooning pool.

Segment i covers pool tokens [base_i, base_i + tokens_i) and is its own device allocation, so one can
be added or freed without touching the others. A block must lie inside one segment (the pool keeps a
gap between segments so that free extents never coalesce across them). Implements `BlockMover`.
"""

from __future__ import annotations

import bisect

import torch

from backends.base import Arena, Block, KVLayout, Span, copy_kv
from backends.errors import BackendError


class SegmentedArena:
    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._bases: list[int] = []  # sorted
        self._arenas: dict[int, Arena] = {}

    def add(self, base: int, arena: Arena) -> None:
        """Map `arena` at pool token `base`; it must not overlap a mapped segment."""
        if arena.layout != self.layout:
            raise BackendError(f"segment layout {arena.layout} differs from the pool's {self.layout}")
        if base < 0 or base in self._arenas:
            raise BackendError(f"a segment is already mapped at token {base}")
        i = bisect.bisect_left(self._bases, base)
        if i > 0 and self._end(self._bases[i - 1]) > base:
            raise BackendError(f"segment at {base} overlaps the one at {self._bases[i - 1]}")
        if i < len(self._bases) and base + arena.total_tokens > self._bases[i]:
            raise BackendError(f"segment at {base} overlaps the one at {self._bases[i]}")
        self._bases.insert(i, base)
        self._arenas[base] = arena

    def remove(self, base: int) -> Arena:
        """Unmap the segment at `base` and return its arena (the caller frees it through the backend)."""
        arena = self._arenas.pop(base, None)
        if arena is None:
            raise BackendError(f"no segment is mapped at token {base}")
        self._bases.remove(base)
        return arena

    def segments(self) -> list[tuple[int, Arena]]:
        return [(b, self._arenas[b]) for b in self._bases]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arenas.values())

    def _end(self, base: int) -> int:
        return base + self._arenas[base].total_tokens

    def locate(self, block: Block) -> tuple[Arena, Span]:
        """The segment holding the block, and the block in that segment's own coordinates."""
        i = bisect.bisect_right(self._bases, block.offset) - 1
        if i < 0 or block.end > self._end(self._bases[i]):
            raise BackendError(f"block {block} does not lie inside one mapped segment")
        base = self._bases[i]
        return self._arenas[base], Span(block.offset - base, block.capacity)

    def view(self, block: Block) -> torch.Tensor:
        arena, local = self.locate(block)
        return arena.view(local)

    def copy(self, src: Block, dst: Block, n_tokens: int) -> None:
        """The migration copy (`copy_kv`), also between segments (each side is one contiguous range)."""
        copy_kv(self.view, src, dst, n_tokens)
