"""The narrow KV interface the replay drives, and its contiguous implementation over the real `KVPool`.

The replay never sees blocks or pages: it asks to admit, grow, release or evict a request and gets a
capacity in tokens (or None: no room now), like vLLM's scheduler sees `allocate_slots`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from odma.allocator import KVPool
from odma.buckets import BucketManager
from odma.policy import KVRequest, Reservation, ReservationPolicy, SizedRequest


@dataclass(frozen=True, slots=True)
class Growth:
    capacity: int  # tokens the request may now hold
    copied_tokens: int  # tokens a migration moved (0 when the block grew in place or a page was added)


class KVManager(ABC):
    """Memory mechanism under one policy; all sizes in tokens."""

    name: str

    @property
    @abstractmethod
    def total_tokens(self) -> int:
        """Token slots of the whole KV budget."""

    @property
    @abstractmethod
    def max_request_tokens(self) -> int:
        """The largest prompt + output a single request may ever need."""

    @abstractmethod
    def admit(self, req: KVRequest) -> int | None:
        """Capacity reserved for a new request (>= prompt + 1), or None when there is no room now."""

    @abstractmethod
    def grow(self, request_id: str, held: int, new_len: int) -> Growth | None:
        """Make room for `new_len` tokens (the request holds `held` now); None = no room now."""

    @abstractmethod
    def release(self, request_id: str, realized_output: int) -> None:
        """The request finished with this many output tokens."""

    @abstractmethod
    def evict(self, request_id: str) -> None:
        """Preemption: free the request's memory without logging a realized length."""

    def counters(self) -> dict:
        return {}

    def check(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""


class _ObserveGate(ReservationPolicy):
    """Delegates to the real policy, but lets an eviction skip `observe`: a preempted request has not
    finished, so its length must not enter the bucket window. (KVPool.release always observes.)"""

    def __init__(self, inner: ReservationPolicy) -> None:
        self.inner = inner
        self.name = inner.name
        self.muted = False

    def initial(self, req: SizedRequest) -> Reservation:
        return self.inner.initial(req)

    def grow(self, req: SizedRequest, needed_output: int, current: Reservation) -> Reservation:
        return self.inner.grow(req, needed_output, current)

    @property
    def version(self) -> int:
        return self.inner.version

    def observe(self, realized_len: int) -> None:
        if not self.muted:
            self.inner.observe(realized_len)


class ContiguousKV(KVManager):
    """One contiguous block per request from the real `KVPool`; bucket refreshes driven by completions
    (count-based, so a replay is deterministic)."""

    def __init__(
        self,
        name: str,
        policy: ReservationPolicy,
        total_tokens: int,
        *,
        large_share: float,
        align: int = 16,
        buckets: BucketManager | None = None,
    ) -> None:
        self.name = name
        self.policy = policy
        self.buckets = buckets
        self._gate = _ObserveGate(policy)
        self.pool = KVPool(total_tokens, self._gate, large_share=large_share, align=align)
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

    def admit(self, req: KVRequest) -> int | None:
        block = self.pool.reserve(req)
        return None if block is None else block.capacity

    def grow(self, request_id: str, held: int, new_len: int) -> Growth | None:
        # The replay advances lengths lazily; first tell the pool what the block holds, so a migration
        # copies (and counts) exactly the live tokens.
        old = self.pool.extend(request_id, held)
        new = self.pool.extend(request_id, new_len)
        if new is None:
            return None
        return Growth(new.capacity, 0 if new is old else held)

    def release(self, request_id: str, realized_output: int) -> None:
        self.pool.release(request_id, realized_output)
        self._released += 1
        b = self.buckets
        if b is not None and b.refresh_due() and b.refresh():
            self.bucket_history.append((self._released, b.bounds))

    def evict(self, request_id: str) -> None:
        self._gate.muted = True
        try:
            self.pool.release(request_id, 0)
        finally:
            self._gate.muted = False

    def counters(self) -> dict:
        s = self.pool.stats()
        out = {
            "pool_refusals": s.refusals,
            "migration_refusals": s.migration_refusals,
            "migrated_tokens": s.migrated_tokens,
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
