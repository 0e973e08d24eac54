"""The contiguous KV pool of one device: one block per request, pure bookkeeping (no torch).

Layout: token slots [0, total) in units of `align` tokens, split into a main region and a large region
(the top `large_share`), each an `ExtentMap` of free extents.

Strategy (carving, splitting, coalescing; boundaries drift, memory must not strand):
- A request's block is carved from the front of a free extent of its region (TLSF good fit, O(1)).
- A released block goes onto its bucket's free list (LIFO, bounded). A reservation of the same bucket
  takes the top block when it is large enough and splits the excess back to the extents, so a free-list
  hit is O(1) and never over-reserves.
- When carving fails, every free list is flushed back into the extents (neighbours coalesce), and the
  carve is retried once; only then is the request refused. So free-list blocks never strand memory.
- When bucket bounds change (the policy's version moves), the free lists are flushed too: their sizes
  belong to the old bounds. Live blocks keep their capacity until release.
- Normal requests use the main region only; large-bucket requests and migrations may use both, the
  large region first for large-bucket requests, so overflow always has somewhere to go.
- A block grows in place over the free units right after it when it can (no second range needed), else it
  migrates: allocate, copy through the mover, swap, free the old block.
- Every live request has a `KVHandle` that the pool keeps current across moves.

Ballooning (`odma.kv.balloon`) adds address ranges (segments) and drains them, and window clearing
(`odma.kv.reclaim`) empties a range for a large request; the pool keeps the ranges' state in a `SegmentMap` and
offers the primitives both build on (fence a range, relocate a block), not their policies.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable

from odma.config import PoolConfig
from odma.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    RequestTooLargeError,
    UnknownRequestError,
)
from odma.kv.blocks import LARGE_REGION, MAIN, Block, BlockMover, KVHandle
from odma.kv.buckets import LARGE
from odma.kv.extents import ExtentMap
from odma.kv.policy import KVRequest, Reservation, ReservationPolicy, SizedRequest, validate_request
from odma.kv.segments import SegmentMap
from odma.kv.shared_rows import Shifted

_DEFAULTS = PoolConfig()  # one default per setting: the config dataclass's


@dataclass(slots=True)
class _Live:
    request: SizedRequest
    block: Block
    reservation: Reservation
    length: int  # tokens the block holds now (prompt + generated)
    handle: KVHandle  # the holder's view of `block`, updated with it


@dataclass(slots=True)
class PoolCounters:
    """Events since the pool was made."""

    reservations: int = 0
    refusals: int = 0
    migrations: int = 0
    migrated_tokens: int = 0
    migration_refusals: int = 0
    grown_in_place: int = 0  # of the migrations: blocks extended over the free units after them
    grown_into_neighbours: int = 0  # of the migrations: blocks extended over the free units before (and after) them
    releases: int = 0
    relocations: int = 0  # blocks moved elsewhere at the same size (window clearing, compaction, deflation)
    relocated_tokens: int = 0  # live tokens those moves copied
    # of the tokens moved by slides and growth into neighbours, those whose move overlapped the block's old place: they
    # pass through a temporary, so they are copied twice (a cost model charges them again)
    overlapped_tokens: int = 0
    free_list_hits: int = 0
    flushes: int = 0
    continued: int = 0  # blocks that could not grow and were continued in a new one (`continue_elsewhere`)


@dataclass(slots=True, kw_only=True)
class PoolStats(PoolCounters):
    """A snapshot: sizes now, and the counters."""

    total_tokens: int  # what the pool can hand out now (ballooned segments included)
    bytes_per_token: int
    main_tokens: int
    large_tokens: int
    live_blocks: int
    live_blocks_per_bucket: dict[int, int]
    reserved_tokens: int  # Σ capacity of live blocks
    live_tokens: int  # Σ tokens actually held
    free_tokens: int  # free extents + free-list blocks
    cached_tokens: int  # of which on bucket free lists
    largest_free_extent_tokens: int  # one free extent or cached block as it is now
    # the largest block a reservation could get now: free extents and cached blocks coalesced (a refused carve
    # flushes the free lists first), and the largest range the pool has (the region or segment it lies in)
    largest_reservable_tokens: int
    largest_range_tokens: int

    @property
    def free_bytes(self) -> int:
        return self.free_tokens * self.bytes_per_token

    @property
    def reserved_bytes(self) -> int:
        return self.reserved_tokens * self.bytes_per_token

    @property
    def live_bytes(self) -> int:
        return self.live_tokens * self.bytes_per_token

    @property
    def external_fragmentation(self) -> float:
        """1 - the largest block a reservation could get / what it could get if free memory were one range:
        0 on an idle pool and whenever all free memory can be had as one block."""
        reachable = min(self.free_tokens, self.largest_range_tokens)
        return 0.0 if reachable == 0 else 1.0 - self.largest_reservable_tokens / reachable


@dataclass(slots=True)
class _FreeLists:
    lists: dict[int, list[Block]] = field(default_factory=lambda: defaultdict(list))
    units: int = 0


class KVPool:
    """reserve / extend / release of contiguous blocks; thread-safe."""

    def __init__(
        self,
        total_tokens: int,
        policy: ReservationPolicy,
        *,
        large_share: float = _DEFAULTS.large_share,
        align: int = _DEFAULTS.align,
        bytes_per_token: int = 1,
        mover: BlockMover | None = None,
        on_release: Callable[[SizedRequest, int, Block], None] | None = None,
        free_list_limit: int = 1024,
        worst_case_prompt_share: float = _DEFAULTS.worst_case_prompt_share,
        neighbour_growth: bool = _DEFAULTS.neighbour_growth,
    ) -> None:
        if align < 1 or total_tokens < align:
            raise InvalidRequestError(f"pool of {total_tokens} tokens cannot hold one {align}-token unit")
        if not 0.0 <= large_share < 1.0:
            raise InvalidRequestError(f"large_share must be in [0, 1), got {large_share}")
        self.policy = policy
        self.align = align
        self.bytes_per_token = bytes_per_token
        self.mover = mover
        self.on_release = on_release
        self.free_list_limit = free_list_limit
        if not 0.0 < worst_case_prompt_share <= 1.0:
            raise InvalidRequestError(f"worst_case_prompt_share must be in (0, 1], got {worst_case_prompt_share}")
        self.worst_case_prompt_share = worst_case_prompt_share
        # a block that cannot grow in place may grow over the free units before it too (an overlapping copy)
        self.neighbour_growth = neighbour_growth
        units = total_tokens // align
        self._large_units = int(units * large_share)
        self._main_units = units - self._large_units
        self._units = units
        self._max_plain_units = max(self._main_units, self._large_units)  # largest range without segments
        self._regions = {MAIN: ExtentMap(), LARGE_REGION: ExtentMap()}
        self._regions[MAIN].add_range(0, self._main_units)
        self._regions[LARGE_REGION].add_range(self._main_units, self._large_units)
        self._live: dict[str, _Live] = {}
        self._free = _FreeLists()
        self._free_version = policy.version
        self._n = PoolCounters()
        self._reserved_units = 0
        self._live_tokens = 0
        self._lock = threading.RLock()
        # ballooning: extra address ranges, ranges being drained, units held out of use
        self._seg = SegmentMap(self._regions, units)

    @classmethod
    def from_bytes(cls, budget_bytes: int, bytes_per_token: int, policy: ReservationPolicy, **kw) -> "KVPool":
        if bytes_per_token < 1:
            raise InvalidRequestError(f"bytes_per_token must be >= 1, got {bytes_per_token}")
        return cls(budget_bytes // bytes_per_token, policy, bytes_per_token=bytes_per_token, **kw)

    # -- sizes -------------------------------------------------------------------------------------

    @property
    def total_tokens(self) -> int:
        return self._units * self.align

    @property
    def max_request_tokens(self) -> int:
        """The largest block this pool can hand out (prompt + output tokens): its largest contiguous range."""
        return self._largest_range_units() * self.align

    def _largest_range_units(self, region: str | None = None) -> int:
        """Largest contiguous address range (of `region`, or any), segments being drained excluded."""
        if not self._seg.segments:  # the common case, on the reserve hot path: no ballooned segments
            if region == MAIN:
                return self._main_units
            return self._large_units if region == LARGE_REGION else self._max_plain_units
        ranges = [] if region == LARGE_REGION else [self._main_units]
        if region != MAIN:
            ranges.append(self._large_units)
        ranges += self._seg.open_ranges(region)
        return max(ranges)

    def _units_for(self, tokens: int) -> int:
        return -(-tokens // self.align)

    # -- public API --------------------------------------------------------------------------------

    def reserve(self, req: SizedRequest) -> Block | None:
        """A block for the prompt plus the policy's output reservation; None when there is no room now."""
        validate_request(req)
        rid, prompt, align = req.request_id, req.prompt_tokens, self.align
        with self._lock:
            if rid in self._live:
                raise DuplicateRequestError(f"request {rid} already holds a block")
            res = self._initial(req)
            units = -(-(prompt + res.output_tokens) // align)
            segmented = bool(self._seg.segments)  # no segments: the fast path of _largest_range_units, without the calls
            if res.bucket != LARGE and units > (self._largest_range_units(MAIN) if segmented else self._main_units):
                res = Reservation(res.output_tokens, LARGE)  # only the large bucket can hold it
            # Admit only what can always finish: prompt + max_new_tokens must fit one block of the pool.
            largest = self._largest_range_units() if segmented else self._max_plain_units
            if -(-(prompt + req.max_new_tokens) // align) > largest:
                raise RequestTooLargeError(
                    f"request {rid} may need {prompt} prompt + {req.max_new_tokens} new "
                    f"tokens, more than the largest block this pool can hold ({largest * align} tokens); "
                    "lower max_new_tokens or enlarge the pool"
                )
            large = res.bucket == LARGE
            block = self._carve(units, res.bucket, prefer_large=large, allow_large=large)
            if block is None:
                self._n.refusals += 1
                return None
            self._live[rid] = _Live(req, block, res, prompt, KVHandle(rid, block.capacity, block))
            self._reserved_units += units
            self._live_tokens += prompt
            self._n.reservations += 1
            return block

    def could_reserve(self, req: SizedRequest) -> bool:
        """Would reserve(req) find room now? Allocates nothing; it flushes the free lists (as a refused reserve
        does) only when their cached blocks could coalesce into the missing room."""
        with self._lock:
            res = self._initial(req)
            units = -(-(req.prompt_tokens + res.output_tokens) // self.align)
            stack = self._free.lists.get(res.bucket)
            if stack and stack[-1].capacity // self.align >= units:
                return True
            large = res.bucket == LARGE or units > self._largest_range_units(MAIN)
            regions = [self._regions[MAIN], self._regions[LARGE_REGION]] if large else [self._regions[MAIN]]
            if max(r.largest() for r in regions) >= units:
                return True
            if self._free.units and sum(r.free_units for r in regions) + self._free.units >= units:
                self._flush()
                return max(r.largest() for r in regions) >= units
            return False

    def extend(self, req: SizedRequest | str, new_len: int) -> Block | None:
        """Make the block hold `new_len` tokens (prompt + generated): the same block if it fits, else a
        migration to the policy's growth target. None = no room to migrate now (the old block stays)."""
        with self._lock:
            live = self._lookup(req)
            r = live.request
            limit = r.prompt_tokens + r.max_new_tokens
            if isinstance(new_len, bool) or not isinstance(new_len, int) or not live.length <= new_len <= limit:
                raise InvalidRequestError(
                    f"request {r.request_id}: new length must be an integer in [{live.length}, {limit}], got {new_len!r}"
                )
            old = live.block
            if new_len <= old.capacity:
                self._live_tokens += new_len - live.length
                live.length = new_len
                return old
            res, units = self._growth_target(live, new_len)
            if units * self.align < new_len:
                raise RequestTooLargeError(f"request {r.request_id}: {new_len} tokens exceed the largest block")
            new = self._grow_in_place(old, units, res.bucket)
            if new is None and self.neighbour_growth:
                new = self._grow_into_neighbours(old, units, res.bucket)
            if new is None:
                new = self._carve(units, res.bucket, prefer_large=res.bucket == LARGE, allow_large=True)
            if new is None:  # the failed carve flushed the free lists: the neighbours may be free now
                new = self._grow_in_place(old, units, res.bucket)
                if new is None and self.neighbour_growth:
                    new = self._grow_into_neighbours(old, units, res.bucket)
            if new is None:
                self._n.migration_refusals += 1
                return None
            in_place = new.offset == old.offset
            over_old = new.offset <= old.offset and old.end <= new.end  # the old block lies inside the new one
            if self.mover is not None:
                try:
                    self.mover.copy(old, new, live.length)
                except BaseException:
                    # the request keeps its old block (after a failed in-place layout its K/V is not to be
                    # trusted: the error fails it, as a failed step does)
                    if over_old:
                        self._free_around(old, new)
                    else:
                        self._give_back(new)
                    raise
            self._n.grown_in_place += in_place
            self._n.grown_into_neighbours += over_old and not in_place
            self._n.overlapped_tokens += live.length if over_old and not in_place else 0
            # the swap: from here on the request's KV is the new block
            self._move(live, new)
            live.reservation = res
            self._reserved_units += units - old.capacity // self.align
            self._n.migrations += 1
            self._n.migrated_tokens += live.length
            self._live_tokens += new_len - live.length
            live.length = new_len
            if not over_old:
                self._recycle(old)
            return new

    def release(self, req: SizedRequest | str, realized_len: int, *, observe: bool = True) -> Block:
        """Free the request's block and log its realized output length for the bucket manager.
        observe=False frees without logging (a preempted or cancelled request: its length is not realized)."""
        with self._lock:
            live = self._lookup(req)
            r = live.request
            if type(realized_len) is not int or not 0 <= realized_len <= r.max_new_tokens:  # bool is rejected too
                raise InvalidRequestError(
                    f"request {r.request_id}: realized length must be an integer in [0, {r.max_new_tokens}], "
                    f"got {realized_len!r}"
                )
            del self._live[r.request_id]
            block = live.block
            self._reserved_units -= block.capacity // self.align
            self._live_tokens -= live.length
            self._n.releases += 1
            self._recycle(block)
        if observe:
            self.policy.observe(realized_len)
            if self.on_release is not None:
                self.on_release(r, realized_len, block)
        return block

    def keep_front(self, req: SizedRequest | str, tokens: int, *, as_id: str | None = None) -> Block:
        """The request has ended but others read its first `tokens` rows: its block shrinks in place to them (rounded
        up to the alignment; the tail goes back to the free extents, the rows are re-laid for the smaller capacity by
        the mover) and stays live, holding those rows only, until `release(as_id or req, 0, observe=False)`. With
        `as_id` the rows live on under that id (the request itself may come back, after a preemption), its handle
        renamed with them. Its realized length is the caller's to log (`policy.observe`)."""
        with self._lock:
            live = self._lookup(req)
            rid = live.request.request_id
            if as_id is not None and as_id != rid and as_id in self._live:
                raise DuplicateRequestError(f"request {as_id} already holds a block")
            if type(tokens) is not int or not 1 <= tokens <= live.length:
                raise InvalidRequestError(f"request {rid}: rows to keep must be an integer in [1, {live.length}], "
                                          f"got {tokens!r}")
            old = live.block
            units = self._units_for(tokens)
            new = Block(old.offset, units * self.align, old.bucket, old.region)
            if new.capacity < old.capacity:
                if self.mover is not None:
                    self.mover.copy(old, new, tokens)
                tail = Block(new.end, old.capacity - new.capacity, old.bucket, old.region)
                if not (self._seg.fences and self._seg.withhold_if_fenced(tail, self.align)):
                    self._give_back(tail)
                self._move(live, new)
                self._reserved_units -= tail.capacity // self.align
            self._live_tokens -= live.length - tokens
            live.length = tokens
            if as_id is not None and as_id != rid:
                self._live[as_id] = self._live.pop(rid)
                rid = live.handle.request_id = as_id
            live.request = KVRequest(rid, tokens, 0)
            return new

    def continue_elsewhere(self, req: SizedRequest | str, new_len: int, *, as_id: str) -> Block | None:
        """The request's block cannot grow where it lies: the rows it holds stay there, under `as_id` (a block of
        their own with a handle of its own, as `keep_front` leaves them), and the request goes on in a new block that
        holds its rows from there on: as many as the grown block would have held beyond them, else (no such room) as
        many as `new_len` needs. Nothing is copied.
        The request's handle stays its own, now on the new block; the rows left behind are the caller's to have read
        (`KVHandle.pieces`) and to release. None: no room for the new block (nothing changes)."""
        with self._lock:
            live = self._lookup(req)
            r = live.request
            if as_id in self._live:
                raise DuplicateRequestError(f"request {as_id} already holds a block")
            rows, limit = live.length, r.prompt_tokens + r.max_new_tokens
            if type(new_len) is not int or not rows < new_len <= limit:
                raise InvalidRequestError(f"request {r.request_id}: new length must be an integer in "
                                          f"({rows}, {limit}], got {new_len!r}")
            res, units = self._growth_target(live, new_len)
            new = None
            # the growth the policy wants beyond the rows left behind, else only what `new_len` needs
            for units in dict.fromkeys((self._units_for(units * self.align - rows), self._units_for(new_len - rows))):
                new = self._carve(units, res.bucket, prefer_large=res.bucket == LARGE, allow_large=True)
                if new is not None:
                    break
            if new is None:  # the refusal was counted by the `extend` that could not grow the block
                return None
            old = live.block  # whole: rows past `rows` it never held stay unused until it is freed (no re-layout)
            self._live[as_id] = _Live(KVRequest(as_id, rows, 0), old, live.reservation, rows,
                                      KVHandle(as_id, old.capacity, old))
            live.request = Shifted(r, rows)
            live.reservation = res
            live.length = new_len - rows
            self._move(live, new)
            self._reserved_units += units
            self._live_tokens += new_len - rows
            self._n.continued += 1
            return new

    def block_of(self, req: SizedRequest | str) -> Block:
        with self._lock:
            return self._lookup(req).block

    def handle_of(self, req: SizedRequest | str) -> KVHandle:
        """The request's handle: the same object for its whole life in the pool, kept current across moves."""
        with self._lock:
            return self._lookup(req).handle

    def length_of(self, req: SizedRequest | str) -> int:
        with self._lock:
            return self._lookup(req).length

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def live_requests(self) -> list[str]:
        with self._lock:
            return list(self._live)

    def flush_free_lists(self) -> None:
        with self._lock:
            self._flush()

    # -- ranges taken back: segments, fences, relocation ---------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        """Token slots the pool can hand out now: the initial range plus segments, less withheld units."""
        with self._lock:
            return (self._units + self._seg.units() - self._seg.withheld_units()) * self.align

    @property
    def ranges(self) -> SegmentMap:
        """The segments, fences and withheld units over this pool's free extents; change them under `lock`
        (ballooning adds and removes segments through it, `odma.kv.balloon`)."""
        return self._seg

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
            self._move(live, new)
            self._recycle(old)
            self._n.relocations += 1
            self._n.relocated_tokens += live.length
            return new

    def slide(self, req: SizedRequest | str, new_offset: int) -> Block | None:
        """Move a live block over the free units right before or after it, to `new_offset` (same capacity and
        region), closing that gap. Its old and new place may overlap (the mover copies such a move in the order
        that reads every part before overwriting it). None when the units between are not free, or while ranges
        are fenced or segments lent (their bookkeeping is not slid)."""
        with self._lock:
            live = self._lookup(req)
            old = live.block
            a = self.align
            if new_offset % a or new_offset < 0 or new_offset == old.offset:
                raise InvalidRequestError(f"request {live.request.request_id}: cannot slide {old} to offset {new_offset}")
            if self._seg.segments or self._seg.fences:
                return None
            region = self._regions[old.region]
            start, end = old.offset // a, old.end // a
            if new_offset < old.offset:  # down: take the gap before, give back the old tail
                gap = start - new_offset // a
                extent = region.start_of_extent_ending_at(start)
                if extent is None or extent > start - gap:
                    return None
                region.carve(extent, start - gap, gap)
                taken, freed = (start - gap, gap), (end - gap, gap)
            else:  # up: take the gap after, give back the old head
                gap = new_offset // a - start
                if not region.take_front(end, gap):
                    return None
                taken, freed = (end, gap), (start, gap)
            new = Block(new_offset, old.capacity, old.bucket, old.region)
            if self.mover is not None:
                try:
                    self.mover.copy(old, new, live.length)
                except BaseException:
                    region.free(*taken)
                    raise
            region.free(*freed)
            self._move(live, new)
            self._n.relocations += 1
            self._n.relocated_tokens += live.length
            self._n.overlapped_tokens += live.length if gap < old.capacity // a else 0
            return new

    def free_extents(self, region: str) -> list[tuple[int, int]]:
        """(start unit, units) of `region`'s free extents in address order (cached free-list blocks not among them:
        `flush_free_lists` first)."""
        with self._lock:
            return list(self._regions[region].extents())

    # the primitives odma.kv.reclaim builds window clearing from; callers hold `lock` across them

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def _growth_target(self, live: _Live, new_len: int) -> tuple[Reservation, int]:
        """The policy's growth reservation for `new_len` tokens and the units of the block it needs."""
        r = live.request
        res = self.policy.grow(r, new_len - r.prompt_tokens, live.reservation)
        units = self._units_for(r.prompt_tokens + max(res.output_tokens, new_len - r.prompt_tokens))
        return res, min(units, self._largest_range_units())

    def growth_units(self, req: SizedRequest | str, new_len: int) -> tuple[int, bool] | None:
        """(units, whether it may lie in the large region) of the block `extend(req, new_len)` would migrate to;
        None when its block holds `new_len` already."""
        with self._lock:
            live = self._lookup(req)
            if new_len <= live.block.capacity:
                return None
            res, units = self._growth_target(live, new_len)
            return units, res.bucket == LARGE or units > self._largest_range_units(MAIN)

    def reservation_units(self, req: SizedRequest) -> tuple[int, bool] | None:
        """(units, whether it may lie in the large region) of the block `reserve(req)` would carve now; None when
        reserve refuses the request as too large for any range."""
        validate_request(req)
        with self._lock:
            if self._units_for(req.prompt_tokens + req.max_new_tokens) > self._largest_range_units():
                return None
            res = self._initial(req)
            units = self._units_for(req.prompt_tokens + res.output_tokens)
            return units, res.bucket == LARGE or units > self._largest_range_units(MAIN)

    @property
    def free_units(self) -> int:
        """Units not held by a live block nor withheld: free extents and cached blocks."""
        with self._lock:
            return sum(r.free_units for r in self._regions.values()) + self._free.units

    def live_spans(self) -> list[tuple[str, Block, int]]:
        """(request id, block, tokens held) of every live request."""
        with self._lock:
            return [(rid, live.block, live.length) for rid, live in self._live.items()]

    def base_ranges(self, large: bool) -> list[tuple[int, int, str]]:
        """The base address range (start unit, units, region) of the main region and, when `large`, the large
        one. Segments are never windows: they are small, and they are lent to be taken back."""
        base = [(0, self._main_units, MAIN), (self._main_units, self._large_units, LARGE_REGION)]
        return [r for r in base[: 2 if large else 1] if r[1] > 0]

    def fence_range(self, start_unit: int, units: int, region: str) -> None:
        """Withhold `region`'s free units in [start_unit, start_unit + units) and every block given back there,
        until `lift_range`; cached blocks go back to the extents first, so none inside is handed out."""
        with self._lock:
            self._flush()
            self._seg.fence(start_unit, units, region)

    def lift_range(self, start_unit: int, units: int, region: str) -> None:
        """Undo `fence_range`: the range's withheld units are free again."""
        with self._lock:
            self._seg.lift(start_unit, units, region)

    # -- internals ---------------------------------------------------------------------------------

    def _initial(self, req: SizedRequest) -> Reservation:
        """The policy's reservation, or the worst case (the large bucket) for a prompt longer than
        `worst_case_prompt_share` of the largest range: migrating it would need a second range at least that
        large while the first is held, so it could grow only in place; the extra reservation is at most
        max_new_tokens against a prompt that size."""
        if self.worst_case_prompt_share < 1.0 and req.prompt_tokens > self.worst_case_prompt_share * self.align * self._largest_range_units():
            return Reservation(req.max_new_tokens, LARGE)
        return self.policy.initial(req)

    @staticmethod
    def _move(live: _Live, block: Block) -> None:
        """The swap: from here on the request's KV is `block` (its holder sees it through the handle)."""
        live.block = live.handle.block = block
        live.handle.capacity = block.capacity

    def _lookup(self, req: SizedRequest | str) -> _Live:
        rid = req if type(req) is str else getattr(req, "request_id", None)
        live = self._live.get(rid) if type(rid) is str else None
        if live is None:
            raise UnknownRequestError(f"request {rid!r} holds no block in this pool (never reserved or already released)")
        return live

    def _carve(self, units: int, bucket: int, *, prefer_large: bool, allow_large: bool) -> Block | None:
        if self.policy.version != self._free_version:
            self._flush()  # free-list sizes belong to the old bounds
            self._free_version = self.policy.version
        # The bucket's free list first: its top block, when large enough (O(1), the common case).
        stack = self._free.lists.get(bucket)
        if stack:
            top = stack[-1]
            have = top.capacity // self.align
            if have >= units and (allow_large or top.region != LARGE_REGION):
                stack.pop()
                self._free.units -= have
                self._n.free_list_hits += 1
                if have > units:  # split: the tail goes back to the extents (and coalesces there)
                    self._regions[top.region].free(top.offset // self.align + units, have - units)
                return Block(top.offset, units * self.align, bucket, top.region)
        order = (LARGE_REGION, MAIN) if prefer_large else (MAIN, LARGE_REGION) if allow_large else (MAIN,)
        for attempt in range(2):
            for region in order:
                start = self._regions[region].allocate(units)
                if start is not None:
                    return Block(start * self.align, units * self.align, bucket, region)
            if attempt == 0 and self._free.units:
                self._flush()
            else:
                break
        return None

    def _grow_in_place(self, old: Block, units: int, bucket: int) -> Block | None:
        """The block extended over the free units right after it, or None. The KV still has to be laid out
        for the new capacity (the mover's copy of a block onto itself), but no second range is needed: a
        block of most of the pool can still grow."""
        if self._regions[old.region].take_front(old.end // self.align, units - old.capacity // self.align):
            return Block(old.offset, units * self.align, bucket, old.region)
        return None

    def _grow_into_neighbours(self, old: Block, units: int, bucket: int) -> Block | None:
        """The block extended over the free units on both sides of it (after it first), or None: growth that needs
        no second range, only gaps beside the block that are too small for anything else. The new block begins
        before the old one, so the copy overlaps it (the mover moves it front first)."""
        region = self._regions[old.region]
        start, end = old.offset // self.align, old.end // self.align
        more = units - (end - start)
        after = min(region.size_at(end), more)
        before_start = region.start_of_extent_ending_at(start)
        before = 0 if before_start is None else start - before_start
        if before + after < more or before == 0:
            return None  # no room, or all of it after the block (_grow_in_place's case)
        if after:
            region.take_front(end, after)
        region.carve(before_start, start - (more - after), more - after)
        return Block((start - (more - after)) * self.align, units * self.align, bucket, old.region)

    def _free_around(self, old: Block, new: Block) -> None:
        """Give back what `new` took beside `old` (a growth in place or into neighbours that failed)."""
        region = self._regions[old.region]
        if new.offset < old.offset:
            region.free(new.offset // self.align, (old.offset - new.offset) // self.align)
        if new.end > old.end:
            region.free(old.end // self.align, (new.end - old.end) // self.align)

    def _recycle(self, block: Block) -> None:
        if self._seg.fences and self._seg.withhold_if_fenced(block, self.align):
            return
        stack = self._free.lists[block.bucket]
        if len(stack) < self.free_list_limit:
            stack.append(block)
            self._free.units += block.capacity // self.align
        else:
            self._give_back(block)

    def _give_back(self, block: Block) -> None:
        self._regions[block.region].free(block.offset // self.align, block.capacity // self.align)

    def _flush(self) -> None:
        if self._free.units:
            self._n.flushes += 1
        for stack in self._free.lists.values():
            for block in stack:
                self._give_back(block)
            stack.clear()
        self._free.units = 0

    # -- observability -----------------------------------------------------------------------------

    # What stats() reports, without building the record (placement reads these per request).
    @property
    def reserved_tokens(self) -> int:
        """Σ capacity of live blocks."""
        return self._reserved_units * self.align

    @property
    def live_tokens(self) -> int:
        """Σ tokens held in live blocks."""
        return self._live_tokens

    @property
    def migrated_tokens(self) -> int:
        """Σ live tokens copied by growth (migrations and in-place re-layouts) so far."""
        return self._n.migrated_tokens

    @property
    def relocated_tokens(self) -> int:
        """Σ live tokens copied by relocations (window clearing, compaction, deflation) so far."""
        return self._n.relocated_tokens

    @property
    def overlapped_tokens(self) -> int:
        """Σ tokens of moves that overlapped the block's old place (copied through a temporary: twice)."""
        return self._n.overlapped_tokens

    @property
    def live_blocks(self) -> int:
        return len(self._live)

    def stats(self) -> PoolStats:
        with self._lock:
            per_bucket: dict[int, int] = defaultdict(int)
            for live in self._live.values():
                per_bucket[live.block.bucket] += 1
            cached = self._free.units
            largest = max(r.largest() for r in self._regions.values())
            for stack in self._free.lists.values():
                for b in stack:
                    largest = max(largest, b.capacity // self.align)
            free_units = sum(r.free_units for r in self._regions.values()) + cached
            reservable = self._largest_coalesced_units()
            return PoolStats(
                total_tokens=self.capacity_tokens,  # segments included, units being drained excluded
                bytes_per_token=self.bytes_per_token,
                main_tokens=(self._main_units + self._seg.units(MAIN)) * self.align,
                large_tokens=(self._large_units + self._seg.units(LARGE_REGION)) * self.align,
                live_blocks=len(self._live),
                live_blocks_per_bucket=dict(per_bucket),
                reserved_tokens=self._reserved_units * self.align,
                live_tokens=self._live_tokens,
                free_tokens=free_units * self.align,
                cached_tokens=cached * self.align,
                largest_free_extent_tokens=largest * self.align,
                largest_reservable_tokens=reservable * self.align,
                largest_range_tokens=self._largest_range_units() * self.align,
                **asdict(self._n),
            )

    def _largest_coalesced_units(self) -> int:
        """Largest free run per region once cached blocks rejoin their neighbouring extents (what a flush
        makes of them), without flushing."""
        best = 0
        for name, extents in self._regions.items():
            spans = sorted([*extents.extents(), *((b.offset // self.align, b.capacity // self.align)
                                                   for stack in self._free.lists.values() for b in stack
                                                   if b.region == name)])
            run_start = run_end = None
            for start, size in spans:
                if run_end != start:
                    run_start = start
                run_end = start + size
                best = max(best, run_end - run_start)
        return best

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by the property tests)."""
        with self._lock:
            spans: list[tuple[int, int, str]] = []
            for live in self._live.values():
                b = live.block
                assert b.offset % self.align == 0 and b.capacity % self.align == 0 and b.capacity > 0
                assert live.request.prompt_tokens <= live.length <= b.capacity
                spans.append((b.offset // self.align, b.capacity // self.align, "live"))
            cached = 0
            for stack in self._free.lists.values():
                for b in stack:
                    spans.append((b.offset // self.align, b.capacity // self.align, "cached"))
                    cached += b.capacity // self.align
            assert cached == self._free.units
            for name, region in self._regions.items():
                region.check()
                lo, hi = (0, self._main_units) if name == MAIN else (self._main_units, self._units)
                for s, n in region.extents():
                    assert lo <= s and s + n <= hi or self._seg.segment_of(s, n, name) is not None, (
                        f"free extent {s}+{n} outside region {name}")
                    spans.append((s, n, "free"))
            spans.extend((s, n, "withheld") for s, n in self._seg.withheld.items())
            self._seg.check()
            spans.sort()
            i = 0
            for lo, size in [(0, self._units)] + sorted((s, n) for s, (n, _) in self._seg.segments.items()):
                pos = lo
                while i < len(spans) and spans[i][0] < lo + size:
                    s, n, kind = spans[i]
                    assert s >= pos, f"overlap at unit {s} ({kind})"
                    assert s == pos, f"lost units [{pos}, {s})"
                    pos, i = s + n, i + 1
                assert pos == lo + size, f"bytes not conserved: covered {pos - lo} of {size} units at {lo}"
            assert i == len(spans), f"span {spans[i] if i < len(spans) else ''} outside the address space"
            assert self._reserved_units == sum(l.block.capacity for l in self._live.values()) // self.align
            assert self._live_tokens == sum(l.length for l in self._live.values())
