"""Ballooning a contiguous KV pool without virtual memory: segments in, segments out (eLLM-style).

inflate: allocate a device segment (its own arena), map it into the pool's token address space after a
  one-unit gap (so free extents never coalesce across segments and every block stays inside one
  allocation), and hand its units to the pool as free space.
deflate: fence a segment (its free units are withheld and every block given back inside it is withheld
  too), migrate each live block in it elsewhere through the pool's mover (contiguous copies, the same
  swap as growth migration), then drop it from the pool, unmap it and free the device memory.
  If any block cannot be moved, the fence is lifted (rollback): the segment is usable again, moved
  blocks stay valid where they are, and no request is lost. Live blocks are only ever touched through
  `KVPool.relocate` (copy, then swap).
The first arena (the pool's initial range) is never deflated: without VMM it is one allocation.
Both operations are explicit, return a result value, and update `BalloonMetrics`.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Any

from odma.errors import ConfigError
from odma.kv.blocks import MAIN
from odma.kv.pool import KVPool


@dataclass(frozen=True, slots=True)
class Segment:
    start_unit: int
    units: int
    region: str
    align: int

    @property
    def offset(self) -> int:
        return self.start_unit * self.align

    @property
    def tokens(self) -> int:
        return self.units * self.align


@dataclass(frozen=True, slots=True)
class DeflateResult:
    ok: bool
    segment: Segment | None
    moved_blocks: int = 0
    moved_tokens: int = 0  # live tokens copied by the evacuation
    freed_bytes: int = 0
    reason: str = ""


@dataclass(slots=True)
class BalloonMetrics:
    inflations: int = 0
    deflations: int = 0
    deflate_rollbacks: int = 0
    inflated_bytes: int = 0
    deflated_bytes: int = 0
    moved_blocks: int = 0
    moved_bytes: int = 0  # live KV bytes copied by evacuations
    segment_bytes_now: int = 0
    history: list[tuple[str, int]] = field(default_factory=list)  # (event, segment bytes after it)

    def snapshot(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in (
            "inflations", "deflations", "deflate_rollbacks", "inflated_bytes", "deflated_bytes",
            "moved_blocks", "moved_bytes", "segment_bytes_now")}


class BalloonPool:
    """Segments over a `KVPool`. With a backend, a base arena and a layout, segments are real device
    arenas in a `SegmentedArena` that becomes the pool's mover; without them it is bookkeeping only."""

    def __init__(self, pool: KVPool, segment_tokens: int, *, backend: Any = None, base_arena: Any = None,
                 layout: Any = None) -> None:
        if segment_tokens < pool.align or segment_tokens % pool.align:
            raise ConfigError(f"segment_tokens must be a positive multiple of the pool's align ({pool.align})")
        self.pool = pool
        self.segment_tokens = segment_tokens
        self.metrics = BalloonMetrics()
        self._backend = backend
        self._arenas = None
        self._lock = threading.Lock()
        if backend is not None:
            if layout is None or base_arena is None:
                raise ConfigError("a device-backed balloon needs the base arena and the KV layout")
            from backends.segmented import SegmentedArena  # torch enters only with a backend

            self._arenas = SegmentedArena(layout)
            self._arenas.add(0, base_arena)
            pool.mover = self._arenas

    @property
    def bytes_per_token(self) -> int:
        return self.pool.bytes_per_token

    @property
    def arena(self):
        """The `SegmentedArena` (device-backed balloons only): view blocks through it."""
        return self._arenas

    def segments(self) -> list[Segment]:
        with self.pool.lock:
            return [Segment(s, n, r, self.pool.align) for s, (n, r) in sorted(self.pool.ranges.segments.items())]

    # -- the pool's ranges: a segment added, fenced, drained ---------------------------------------------

    def _add(self, seg: Segment) -> None:
        """The segment's units become free space of its region; it must neither overlap nor touch the address
        space, so no block ever spans two segments."""
        with self.pool.lock:
            self.pool.ranges.add(seg.start_unit, seg.units, seg.region)

    def fence(self, seg: Segment) -> None:
        """Start draining `seg`: its free units and any block given back inside it are withheld (never handed
        out again) until `unfence` (rollback) or `_remove`."""
        with self.pool.lock:
            units, region = self.pool.ranges.segment(seg.start_unit)
            if seg.start_unit not in self.pool.ranges.fences:
                self.pool.fence_range(seg.start_unit, units, region)

    def unfence(self, seg: Segment) -> None:
        """Rollback of `fence`: the segment's withheld units become free again."""
        with self.pool.lock:
            units, region = self.pool.ranges.segment(seg.start_unit)
            if seg.start_unit in self.pool.ranges.fences:
                self.pool.lift_range(seg.start_unit, units, region)

    @property
    def draining(self) -> bool:
        """Is any range of the pool fenced (being drained) now?"""
        return bool(self.pool.ranges.fences)

    def live_in(self, seg: Segment) -> list[str]:
        """Requests whose block lies in `seg`."""
        lo, hi = seg.offset, seg.offset + seg.tokens
        return [rid for rid, block, _ in self.pool.live_spans() if lo <= block.offset < hi]

    def _remove(self, seg: Segment) -> None:
        """Drop a fenced segment whose units are all withheld (no live block left)."""
        with self.pool.lock:
            self.pool.ranges.remove(seg.start_unit)

    # -- inflate ---------------------------------------------------------------------------------------

    def inflate(self, region: str = MAIN, tokens: int | None = None) -> Segment:
        """Add one segment (default size `segment_tokens`); device memory errors propagate unchanged."""
        tokens = self.segment_tokens if tokens is None else tokens
        align = self.pool.align
        if tokens < align or tokens % align:
            raise ConfigError(f"segment size must be a positive multiple of {align} tokens, got {tokens}")
        with self._lock:
            ends = [self.pool.total_tokens // align] + [s.start_unit + s.units for s in self.segments()]
            seg = Segment(max(ends) + 1, tokens // align, region, align)  # +1: the gap
            if self._arenas is not None:
                arena = self._backend.create_segment(seg.tokens, self._arenas.layout)
                self._arenas.add(seg.offset, arena)
            try:
                self._add(seg)
            except BaseException:
                if self._arenas is not None:
                    self._backend.free_arena(self._arenas.remove(seg.offset))
                raise
            nbytes = seg.tokens * self.bytes_per_token
            m = self.metrics
            m.inflations += 1
            m.inflated_bytes += nbytes
            m.segment_bytes_now += nbytes
            m.history.append(("inflate", m.segment_bytes_now))
            return seg

    # -- deflate ---------------------------------------------------------------------------------------

    def deflate(self, segment: Segment | None = None, *, return_to_driver: bool = False) -> DeflateResult:
        """Evacuate and free one segment (default: the one with the fewest live tokens to move)."""
        with self._lock:
            pool = self.pool
            if segment is None:
                candidates = self.segments()
                if not candidates:
                    return DeflateResult(False, None, reason="no segment to deflate")
                segment = min(candidates, key=self.live_tokens_in)
            elif segment not in self.segments():
                raise ConfigError(f"{segment} is not a segment of this pool")
            self.fence(segment)
            moved_blocks = moved_tokens = 0
            # biggest first: they are the hardest to place, so a doomed evacuation fails before copying much
            victims = sorted(self.live_in(segment),
                             key=lambda rid: -pool.block_of(rid).capacity)
            for rid in victims:
                if rid not in pool:  # released meanwhile (its block is then withheld by the fence)
                    continue
                block = pool.block_of(rid)
                if not segment.offset <= block.offset < segment.offset + segment.tokens:
                    continue  # migrated away meanwhile
                n = pool.length_of(rid)
                if pool.relocate(rid) is None:
                    self.unfence(segment)
                    self._account_moves(moved_blocks, moved_tokens)
                    self.metrics.deflate_rollbacks += 1
                    self.metrics.history.append(("rollback", self.metrics.segment_bytes_now))
                    return DeflateResult(False, segment, moved_blocks, moved_tokens,
                                         reason=f"no room outside the segment for {rid} ({block.capacity} tokens)")
                moved_blocks += 1
                moved_tokens += n
            self._remove(segment)
            freed = segment.tokens * self.bytes_per_token
            if self._arenas is not None:
                self._backend.free_arena(self._arenas.remove(segment.offset), return_to_driver=return_to_driver)
            self._account_moves(moved_blocks, moved_tokens)
            m = self.metrics
            m.deflations += 1
            m.deflated_bytes += freed
            m.segment_bytes_now -= freed
            m.history.append(("deflate", m.segment_bytes_now))
            return DeflateResult(True, segment, moved_blocks, moved_tokens, freed)

    def deflate_bytes(self, nbytes: int, *, return_to_driver: bool = False) -> list[DeflateResult]:
        """Deflate segments until at least `nbytes` are freed or one cannot be evacuated."""
        results: list[DeflateResult] = []
        freed = 0
        while freed < nbytes and self.segments():
            r = self.deflate(return_to_driver=return_to_driver)
            results.append(r)
            if not r.ok:
                break
            freed += r.freed_bytes
        return results

    def live_tokens_in(self, seg: Segment) -> int:
        return sum(self.pool.length_of(r) for r in self.live_in(seg))

    def _account_moves(self, blocks: int, tokens: int) -> None:
        self.metrics.moved_blocks += blocks
        self.metrics.moved_bytes += tokens * self.bytes_per_token


class ActivationProfile:
    """Peak activation bytes by prefill token count (profiled once, as vLLM does), linear in between
    and beyond the last point; `deflate_needed` says how many KV bytes to give up before a prefill."""

    def __init__(self, points: dict[int, int]) -> None:
        if not points or any(t < 1 or b < 0 for t, b in points.items()):
            raise ConfigError("activation profile needs points {tokens >= 1: bytes >= 0}")
        self._tokens = sorted(points)
        self._bytes = [points[t] for t in self._tokens]

    def peak_bytes(self, tokens: int) -> int:
        ts, bs = self._tokens, self._bytes
        if tokens <= ts[0]:
            return bs[0]
        i = min(bisect.bisect_left(ts, tokens), len(ts) - 1)
        t0, t1 = (ts[i - 1], ts[i]) if i > 0 else (ts[0], ts[0])
        b0, b1 = (bs[i - 1], bs[i]) if i > 0 else (bs[0], bs[0])
        if t1 == t0:
            return b1
        return max(0, round(b0 + (b1 - b0) * (tokens - t0) / (t1 - t0)))

    def deflate_needed(self, prefill_tokens: int, free_device_bytes: int) -> int:
        return max(0, self.peak_bytes(prefill_tokens) - free_device_bytes)
