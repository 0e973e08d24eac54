"""Growth by mapping: each request's block is a range of address space laid out for the most it may ever hold, and
memory is mapped behind it as it grows; a growing block never moves and no byte is copied.

A block is laid out as every odma block, [layers, 2, V, kv_heads, head_dim], but V is the request's worst case
(prompt + max_tokens) rounded up, so each layer's K and V stay one contiguous range and the attention kernels read
it exactly as a copied block. Only the first `mapped` tokens of each of its 2 x layers planes hold memory. The
device maps memory in granules (2 MiB on NVIDIA GPUs, a 4 KiB page on a host), so a plane grows by `step_tokens`
at a time: the fewest tokens whose K (or V) rows of one layer fill whole granules. The admission maps the prompt
plus the policy's first reservation (odma: its bucket for the predicted length) and reserves address space for
the worst case; growth maps the steps the new length needs; a release unmaps everything.

What it costs: each plane's last step is partly empty (half a step per plane on average, 2 x layers planes per
block). With 4 KiB host pages that is a few tokens (SmolLM2: 16-token steps, the contiguous pool's own unit); with
2 MiB GPU granules and a 7B model's 1 KiB K rows it is 2,048-token steps, so short requests hold much more than
they use: measure before choosing it there (odma-bench gpu).

Bookkeeping only (no torch): the arena maps and unmaps (backends/virtual_arena.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from odma.errors import (ConfigError, DuplicateRequestError, InvalidRequestError, RequestTooLargeError,
                         UnknownRequestError)
from odma.kv.blocks import MAIN, Block, Growth, KVHandle
from odma.kv.extents import ExtentMap
from odma.kv.manager import KVManager
from odma.kv.placement import DeviceLoad
from odma.kv.policy import ReservationPolicy, SizedRequest, validate_request
from odma.kv.pool import PoolStats


class Mapper(Protocol):
    """The arena side: back or free whole granules at a byte offset of the reserved range. The range's first
    `guard_bytes` are not for blocks (a virtual arena keeps its first granule mapped as a guard)."""

    granule_bytes: int
    physical_granules: int
    guard_bytes: int

    def map(self, byte_offset: int, n: int) -> None: ...
    def unmap(self, byte_offset: int, n: int) -> None: ...


@dataclass(frozen=True, slots=True)
class PlaneGeometry:
    """How a block's planes (one layer's K, or V) meet the device's granules."""

    layers: int
    row_bytes: int  # one token's K (or V) of one layer: kv_heads x head_dim x element size
    granule_bytes: int

    def __post_init__(self) -> None:
        if min(self.layers, self.row_bytes, self.granule_bytes) < 1:
            raise ConfigError(f"bad plane geometry {self}")

    @property
    def planes(self) -> int:
        return 2 * self.layers

    @property
    def bytes_per_token(self) -> int:
        return self.planes * self.row_bytes

    @property
    def step_tokens(self) -> int:
        """Tokens of one plane that fill whole granules: the unit a plane grows by."""
        return self.granule_bytes // math.gcd(self.granule_bytes, self.row_bytes)

    @property
    def step_granules(self) -> int:
        return self.step_tokens * self.row_bytes // self.granule_bytes

    @property
    def unit_tokens(self) -> int:
        """Address-space unit: block starts and sizes are multiples of it, so every plane starts on a granule."""
        offset_unit = self.granule_bytes // math.gcd(self.granule_bytes, self.bytes_per_token)
        return math.lcm(offset_unit, self.step_tokens)

    def layout_tokens(self, tokens: int) -> int:
        """A block's layout capacity for `tokens` (rounded up to whole units)."""
        u = self.unit_tokens
        return -(-tokens // u) * u

    def steps(self, tokens: int) -> int:
        return -(-tokens // self.step_tokens)


@dataclass(slots=True)
class _Live:
    request: SizedRequest
    block: Block
    steps: int  # steps mapped in each plane
    length: int
    handle: KVHandle


class MappedKV(KVManager):
    """One block of address space per request, memory mapped behind it as it grows (see the module docstring)."""

    def __init__(self, policy: ReservationPolicy, geometry: PlaneGeometry, mapper: Mapper, virtual_tokens: int,
                 *, name: str | None = None) -> None:
        self.policy = policy
        self.name = name or f"{policy.name}-mapped"
        self.geometry = geometry
        self.mapper = mapper
        if mapper.granule_bytes != geometry.granule_bytes:
            raise ConfigError("the mapper's granule and the geometry's differ")
        unit = geometry.unit_tokens
        first = -(-mapper.guard_bytes // (unit * geometry.bytes_per_token))  # whole units after the guard
        if virtual_tokens // unit <= first:
            raise ConfigError(f"{virtual_tokens} tokens of address space leave no room after the guard")
        self._space = ExtentMap()
        self._space.add_range(first, virtual_tokens // unit - first)
        self.virtual_tokens = (virtual_tokens // unit - first) * unit  # what blocks can use
        self.free_granules = mapper.physical_granules
        self._live: dict[str, _Live] = {}
        self.reservations = self.refusals = self.space_refusals = self.map_failures = 0
        self.releases = self.growths = self.mapped_steps = 0

    # -- sizes ---------------------------------------------------------------------------------------------------

    @property
    def total_tokens(self) -> int:
        """Token slots the physical memory backs (whole steps in every plane)."""
        g = self.geometry
        return self.mapper.physical_granules // (g.planes * g.step_granules) * g.step_tokens

    @property
    def max_request_tokens(self) -> int:
        return min(self.total_tokens, self.virtual_tokens)

    @property
    def reserved_tokens(self) -> int:
        g = self.geometry
        return (self.mapper.physical_granules - self.free_granules) // (g.planes * g.step_granules) * g.step_tokens

    @property
    def live_tokens(self) -> int:
        return sum(live.length for live in self._live.values())

    def _granules(self, steps: int) -> int:
        return steps * self.geometry.planes * self.geometry.step_granules

    def _first_tokens(self, req: SizedRequest) -> int:
        worst = req.prompt_tokens + req.max_new_tokens
        return max(req.prompt_tokens + 1, min(worst, self.policy.initial_tokens(req)))

    def initial_tokens(self, req: SizedRequest) -> int:
        return self._first_tokens(req)

    # -- the door ------------------------------------------------------------------------------------------------

    def can_admit(self, req: SizedRequest) -> bool:
        g = self.geometry
        return (self._granules(g.steps(self._first_tokens(req))) <= self.free_granules
                and self._space.largest() * g.unit_tokens >= g.layout_tokens(req.prompt_tokens + req.max_new_tokens))

    def admit(self, req: SizedRequest) -> KVHandle | None:
        validate_request(req)
        rid = req.request_id
        if rid in self._live:
            raise DuplicateRequestError(f"request {rid} already holds a block")
        g = self.geometry
        worst = req.prompt_tokens + req.max_new_tokens
        layout = g.layout_tokens(worst)
        if g.steps(worst) * g.step_tokens > self.total_tokens or layout > self.virtual_tokens:
            raise RequestTooLargeError(f"request {rid} may need {req.prompt_tokens} prompt + {req.max_new_tokens} new "
                                       f"tokens, more than this memory can ever map ({self.max_request_tokens} "
                                       "tokens); lower max_new_tokens or enlarge the budget")
        bucket = self.policy.initial(req).bucket
        steps = min(g.steps(self._first_tokens(req)), layout // g.step_tokens)
        if self._granules(steps) > self.free_granules:
            self.refusals += 1
            return None
        start = self._space.allocate(layout // g.unit_tokens)
        if start is None:
            self.space_refusals += 1
            return None
        block = Block(start * g.unit_tokens, layout, bucket, MAIN)
        if not self._map(block, 0, steps):
            self._space.free(start, layout // g.unit_tokens)
            return None
        handle = KVHandle(rid, steps * g.step_tokens, block)
        self._live[rid] = _Live(req, block, steps, req.prompt_tokens, handle)
        self.reservations += 1
        return handle

    def grow(self, request_id: str, new_len: int, *, held: int | None = None) -> Growth | None:
        live = self._lookup(request_id)
        g = self.geometry
        if new_len > live.block.capacity:
            raise InvalidRequestError(f"request {request_id} grows to {new_len} tokens, past its worst case "
                                      f"({live.block.capacity})")
        need = g.steps(new_len)
        if need > live.steps:
            if self._granules(need - live.steps) > self.free_granules:
                self.refusals += 1
                return None
            if not self._map(live.block, live.steps, need):
                return None
            self.growths += 1
            live.steps = need
            live.handle.capacity = need * g.step_tokens
        live.length = max(live.length, new_len)
        return Growth(live.handle.capacity, 0)

    def release(self, request_id: str, realized_output: int) -> None:
        live = self._lookup(request_id)
        if type(realized_output) is not int or not 0 <= realized_output <= live.request.max_new_tokens:
            raise InvalidRequestError(f"request {request_id}: realized length must be an integer in "
                                      f"[0, {live.request.max_new_tokens}], got {realized_output!r}")
        self._free(request_id)
        self.policy.observe(realized_output)

    def evict(self, request_id: str) -> None:
        self._lookup(request_id)
        self._free(request_id)

    def observe(self, realized_output: int) -> None:
        self.policy.observe(realized_output)

    def _lookup(self, request_id: str) -> _Live:
        live = self._live.get(request_id)
        if live is None:
            raise UnknownRequestError(f"request {request_id!r} holds no block")
        return live

    def _free(self, request_id: str) -> None:
        live = self._live.pop(request_id)
        self._unmap(live.block, 0, live.steps)
        g = self.geometry
        self._space.free(live.block.offset // g.unit_tokens, live.block.capacity // g.unit_tokens)
        self.releases += 1

    # -- mapping -------------------------------------------------------------------------------------------------

    def _plane_offsets(self, block: Block, first_step: int):
        g = self.geometry
        base = block.offset * g.bytes_per_token
        for p in range(g.planes):
            yield base + (p * block.capacity + first_step * g.step_tokens) * g.row_bytes

    def _map(self, block: Block, have: int, want: int) -> bool:
        """Map steps have..want-1 of every plane; on a failure unmap what this call mapped and report no room."""
        n = (want - have) * self.geometry.step_granules
        done = []
        try:
            for offset in self._plane_offsets(block, have):
                self.mapper.map(offset, n)
                done.append(offset)
        except Exception:  # noqa: BLE001 - a driver refusal is "no room now", never a lost request
            self.map_failures += 1
            for offset in done:
                self.mapper.unmap(offset, n)
            return False
        self.free_granules -= n * len(done)
        self.mapped_steps += (want - have) * self.geometry.planes
        return True

    def _unmap(self, block: Block, have: int, want: int) -> None:
        n = (want - have) * self.geometry.step_granules
        for offset in self._plane_offsets(block, have):
            self.mapper.unmap(offset, n)
        self.free_granules += n * self.geometry.planes

    # -- observability -------------------------------------------------------------------------------------------

    def load(self, device: str, queued_reserve: int = 0, queued_tokens: int = 0) -> DeviceLoad:
        return DeviceLoad(device, self.total_tokens, self.reserved_tokens + queued_reserve,
                          self.live_tokens + queued_tokens, len(self._live))

    def counters(self) -> dict:
        return {"pool_refusals": self.refusals, "space_refusals": self.space_refusals,
                "map_failures": self.map_failures, "growths_by_mapping": self.growths}

    def stats(self) -> PoolStats:
        """The contiguous pool's snapshot for mapped memory: free memory is any free granule, so the largest block
        a reservation can get is all of it (address space permitting). Growths count as grown in place."""
        free = self.total_tokens - self.reserved_tokens
        return PoolStats(
            reservations=self.reservations, refusals=self.refusals + self.space_refusals + self.map_failures,
            grown_in_place=self.growths, releases=self.releases, total_tokens=self.total_tokens,
            bytes_per_token=self.geometry.bytes_per_token, main_tokens=self.total_tokens, large_tokens=0,
            live_blocks=len(self._live), live_blocks_per_bucket={}, reserved_tokens=self.reserved_tokens,
            live_tokens=self.live_tokens, free_tokens=free, cached_tokens=0, largest_free_extent_tokens=free,
            largest_reservable_tokens=free, largest_range_tokens=self.total_tokens)

    def check(self) -> None:
        g = self.geometry
        held = sum(self._granules(live.steps) for live in self._live.values())
        assert held + self.free_granules == self.mapper.physical_granules, "granules not conserved"
        spans = sorted((live.block.offset, live.block.end) for live in self._live.values())
        assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:])), "blocks overlap"
        for live in self._live.values():
            assert live.steps * g.step_tokens <= live.block.capacity
            assert live.length <= live.handle.capacity == live.steps * g.step_tokens
        self._space.check()
