"""The door between scheduling and memory: what a scheduler may ask of KV memory, and the answers it gets.

In the style of vLLM v1's `KVCacheManager`: the scheduler asks to admit, grow, release or evict a request and
gets small value types back (`KVHandle`, `Growth`, or None when there is no room now); it decides what to
preempt. It never sees the pool's internals. `ContiguousKV` is odma's memory (one contiguous block per request
from a `KVPool`, optionally ballooned with an activation reserve); `odma.kv.paged.PagedKV` is vLLM's page-count
model that the replay compares against. The engine's scheduler, the replay and the benchmarks all use this.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from odma.kv.blocks import Growth, KVHandle
from odma.kv.buckets import BucketManager
from odma.kv.elastic import ElasticKV
from odma.kv.placement import DeviceLoad
from odma.kv.policy import SizedRequest
from odma.kv.pool import KVPool, PoolStats
from odma.kv.reclaim import clear_for_growth, clear_window, slide_for_growth
from odma.kv.shared_rows import SharedRows, Shifted

# pieces a request may read its rows from before its block stops continuing elsewhere (it compacts or slides then):
# with a shared prefix's pieces, well within the 8-entry tables captured decode batches read (GRAPH_PIECES)
CONTINUED_PIECES = 4


class KVManager(ABC):
    """Memory under one policy; all sizes in tokens. A request is anything with `SizedRequest`'s fields."""

    name: str = "kv"
    elastic: ElasticKV | None = None  # KV ↔ activation ballooning, when this memory lends and reclaims

    @property
    @abstractmethod
    def total_tokens(self) -> int:
        """Token slots of the whole KV budget."""

    @property
    @abstractmethod
    def max_request_tokens(self) -> int:
        """The largest prompt + output a single request may ever hold."""

    @property
    def capacity_tokens(self) -> int:
        """Token slots that can be handed out now (ballooned segments included)."""
        return self.total_tokens

    @property
    @abstractmethod
    def reserved_tokens(self) -> int:
        """Tokens held by live requests (their whole reservations)."""

    @abstractmethod
    def admit(self, req: SizedRequest) -> KVHandle | None:
        """Memory for a new request (capacity >= prompt + 1), or None when there is no room now."""

    @abstractmethod
    def can_admit(self, req: SizedRequest) -> bool:
        """Would `admit` find room now? Allocates nothing."""

    @abstractmethod
    def grow(self, request_id: str, new_len: int, *, held: int | None = None) -> Growth | None:
        """Make the request's memory hold `new_len` tokens (prompt + generated); None = no room now (it keeps
        what it has). `held`: the tokens it holds before, when the caller tells lengths lazily (the replay)."""

    @abstractmethod
    def release(self, request_id: str, realized_output: int) -> None:
        """The request finished with this many output tokens: free its memory and learn the length."""

    @abstractmethod
    def evict(self, request_id: str) -> None:
        """Free the request's memory without learning a length (preempted, cancelled or failed)."""

    def observe(self, realized_output: int) -> None:
        """Learn a realized length whose memory was already freed (a preempted request that finished later)."""

    def initial_tokens(self, req: SizedRequest) -> int:
        """Tokens the request's first reservation holds (prompt + reserved output, before alignment)."""
        return req.prompt_tokens + req.max_new_tokens

    @property
    def copied_tokens(self) -> int:
        """Σ tokens growth has copied so far (a cost model charges them; pages are never copied)."""
        return 0

    def make_way(self, req: SizedRequest) -> tuple[int, bool]:
        """Move blocks out of the range `req` would need instead of waiting for them to end. Returns (blocks
        moved, cleared): cleared means `admit(req)` finds room now. Handles of moved requests stay valid."""
        return 0, False

    def counters(self) -> dict:
        return {}

    def check(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""


class ContiguousKV(KVManager):
    """One contiguous block per request from a `KVPool`. With `buckets`, bucket bounds are refreshed when due
    after each release (count-based in the replay, so it is deterministic) and the changes are recorded."""

    def __init__(self, pool: KVPool, *, name: str | None = None, elastic: ElasticKV | None = None,
                 buckets: BucketManager | None = None, compact_growth: bool = False, slide_growth: bool = False,
                 read_prefixes: bool = False, continue_growth: bool = False) -> None:
        self.pool = pool
        # a shared prompt prefix read where a running holder keeps it (odma.kv.shared_rows) instead of copied into
        # each block: the scheduler maps it (`admit_sharing`) as it maps a paged pool's pages
        self.shared = SharedRows() if read_prefixes or continue_growth else None
        self.shares_pages = read_prefixes
        self.parked = 0  # blocks of ended requests kept for readers of their rows
        # a block that cannot grow while the pool's free units could hold its growth (fragmentation) gets a range
        # by relocating the blocks in it (odma.kv.reclaim.clear_for_growth): copies instead of a preemption
        self.compact_growth = compact_growth
        # when no window can be cleared (its blocks have nowhere else to go), blocks slide over the gaps between them
        # (odma.kv.reclaim.slide_for_growth): room is found whenever the free units hold the growth
        self.slide_growth = slide_growth
        # a block that cannot grow where it lies goes on in a new block, its rows so far read where they are (a piece,
        # as a shared prefix read in place is): nothing copied, no slide; tried before compaction and sliding
        self.continue_growth = continue_growth
        self.continued = 0  # blocks continued that way (their rows live on under "{request id}/rows-{n}")
        self.slides = 0  # growths that found room only after blocks slid for them
        self.compactions = 0  # growths that found room only after blocks were relocated for them
        self.name = name or pool.policy.name
        self.elastic = elastic
        self.buckets = buckets
        self.bucket_history: list[tuple[int, tuple[int, ...]]] = []  # (completions so far, new bounds)
        self._released = 0
        if buckets is not None:
            self.bucket_history.append((0, buckets.bounds))

    @property
    def total_tokens(self) -> int:
        return self.pool.total_tokens

    @property
    def max_request_tokens(self) -> int:
        return self.pool.max_request_tokens

    @property
    def capacity_tokens(self) -> int:
        return self.pool.capacity_tokens

    @property
    def reserved_tokens(self) -> int:
        return self.pool.reserved_tokens

    def admit(self, req: SizedRequest) -> KVHandle | None:
        if self.pool.reserve(req) is None:
            return None
        return self.pool.handle_of(req.request_id)

    def can_admit(self, req: SizedRequest) -> bool:
        return self.pool.could_reserve(req)

    def shareable_tokens(self, tokens: int) -> int:
        """Of `tokens` shared at the front, those `admit_sharing` reads in place: all of them (rows, not pages)."""
        return tokens

    def admit_sharing(self, req: SizedRequest, holder_id: str | None, tokens: int) -> KVHandle | None:
        """Admit `req` reading the first `tokens` rows where `holder_id`'s block (and the blocks it reads) keep
        them: its own block holds the rest. None: no room now (nothing changes)."""
        if self.shared is None or holder_id is None or not tokens:
            return self.admit(req)
        pieces = self.shared.pieces_for(self.pool.handle_of(holder_id), tokens)
        if self.pool.reserve(Shifted(req, tokens)) is None:
            return None
        handle = self.pool.handle_of(req.request_id)
        self.shared.add(handle, pieces)
        return handle

    def grow(self, request_id: str, new_len: int, *, held: int | None = None) -> Growth | None:
        if self.shared is not None:  # a reader's block holds its rows from its first
            first = self.pool.handle_of(request_id).first_row
            new_len, held = new_len - first, None if held is None else held - first
        pool = self.pool
        old = pool.extend(request_id, held) if held is not None else pool.block_of(request_id)
        length = pool.length_of(request_id)  # what a growth copies
        new = pool.extend(request_id, new_len)
        if new is None and self.continue_growth:
            growth = self._continue(request_id, new_len)
            if growth is not None:
                return growth
        if new is None and self.compact_growth and clear_for_growth(pool, request_id, new_len)[1]:
            new = pool.extend(request_id, new_len)
            self.compactions += new is not None
        if new is None and self.slide_growth and slide_for_growth(pool, request_id, new_len)[1]:
            new = pool.extend(request_id, new_len)
            self.slides += new is not None
        if new is None:
            return None
        return Growth(new.capacity, 0 if new is old else length, new.offset != old.offset)

    def _continue(self, request_id: str, new_len: int) -> Growth | None:
        """The block goes on in a new one where it cannot grow (`KVPool.continue_elsewhere`): its rows so far are read
        where they lie, as a piece. None: the request reads CONTINUED_PIECES pieces already, or no room."""
        handle = self.pool.handle_of(request_id)
        if len(handle.pieces or ()) >= CONTINUED_PIECES:
            return None
        rows = self.pool.length_of(request_id)
        as_id = f"{request_id}/rows-{self.continued + 1}"
        new = self.pool.continue_elsewhere(request_id, new_len, as_id=as_id)
        if new is None:
            return None
        self.continued += 1
        self.shared.continued(handle, self.pool.handle_of(as_id), rows)
        return Growth(new.capacity, 0)

    def release(self, request_id: str, realized_output: int) -> None:
        if not self._parked(request_id):
            self.pool.release(request_id, realized_output)
        else:
            self.pool.policy.observe(realized_output)
        self._released += 1
        b = self.buckets
        if b is not None and b.refresh_due() and b.refresh():
            self.bucket_history.append((self._released, b.bounds))

    def evict(self, request_id: str) -> None:
        if not self._parked(request_id):
            self.pool.release(request_id, 0, observe=False)

    def _parked(self, request_id: str) -> bool:
        """Reading in place: a request that leaves while others read its rows keeps them (its block shrunk in place,
        under an id of its own) and True; else its block goes (by the caller) and so do the parked blocks only it
        still read."""
        if self.shared is None:
            return False
        handle = self.pool.handle_of(request_id)
        keep = self.shared.rows_to_keep(handle)
        if keep is not None:
            self.parked += 1
            self.pool.keep_front(request_id, keep, as_id=f"{request_id}/read-{self.parked}")
            self.shared.park(handle)
            return True
        for gone in self.shared.drop(handle):
            self.pool.release(gone.request_id, 0, observe=False)
        return False

    def observe(self, realized_output: int) -> None:
        self.pool.policy.observe(realized_output)

    def initial_tokens(self, req: SizedRequest) -> int:
        return self.pool.policy.initial_tokens(req)

    @property
    def copied_tokens(self) -> int:
        return self.pool.migrated_tokens

    @property
    def relocated_tokens(self) -> int:
        """Σ live tokens moved at the same size (window clearing, compaction): copies a cost model charges too."""
        return self.pool.relocated_tokens

    def make_way(self, req: SizedRequest) -> tuple[int, bool]:
        return clear_window(self.pool, req)

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def load(self, device: str, queued_reserve: int = 0, queued_tokens: int = 0) -> DeviceLoad:
        """The pool's load, plus what its queue will reserve and attend (a request placed there waits behind it)."""
        p = self.pool
        return DeviceLoad(device, p.capacity_tokens, p.reserved_tokens + queued_reserve, p.live_tokens + queued_tokens,
                          p.live_blocks)

    def counters(self) -> dict:
        s = self.pool.stats()
        out = {
            "pool_refusals": s.refusals,
            "migration_refusals": s.migration_refusals,
            "migrated_tokens": s.migrated_tokens,
            "relocated_tokens": s.relocated_tokens,
            "compactions": self.compactions,
            "slides": self.slides,
            "continued": self.continued,
            "free_list_hits": s.free_list_hits,
            "flushes": s.flushes,
        }
        if self.buckets is not None:
            out["bucket_refreshes"] = self.buckets.refreshes
            out["bucket_bounds_changes"] = self.buckets.version
            out["final_bounds"] = list(self.buckets.bounds)
        return out

    def check(self) -> None:
        self.pool.check_invariants()
