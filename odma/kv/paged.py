"""vLLM's model of KV memory: fixed-size pages allocated on demand.

Pages are interchangeable, so for memory only counts matter (no fragmentation beyond the last page's tail); each
request's handle also lists its page ids in order (`KVHandle.pages`), which is what the engine's paged baseline
reads through a page table. Freed pages are reused last-freed first, so after some churn a request's pages lie
scattered over the arena, as in a running vLLM. Admission keeps a watermark of free pages back, as vLLM does, so
a fresh batch does not preempt at once.

A request whose prompt begins like a running request's cached tokens maps that request's full pages of them into
its own table (`admit_sharing`), as vLLM's prefix caching does: nothing is copied, each page counts its holders and
is free when the last lets go. Only full pages below the holder's cached length are shared, so nobody writes into
a shared page.
"""

from __future__ import annotations

from collections import Counter

from odma.errors import DuplicateRequestError, InvalidRequestError, UnknownRequestError
from odma.kv.blocks import Growth, KVHandle
from odma.kv.manager import KVManager
from odma.kv.placement import DeviceLoad
from odma.kv.policy import SizedRequest
from odma.kv.pool import PoolStats


class PagedKV(KVManager):
    shares_pages = True  # a shared prompt prefix is mapped, not copied (the scheduler asks `admit_sharing`)

    def __init__(self, total_tokens: int, page_tokens: int = 16, watermark: float = 0.01, name: str = "paged",
                 bytes_per_token: int = 0) -> None:
        if page_tokens < 1 or total_tokens < page_tokens:
            raise InvalidRequestError(f"a paged pool of {total_tokens} tokens cannot hold one {page_tokens}-token page")
        if not 0.0 <= watermark < 1.0:
            raise InvalidRequestError(f"watermark must be in [0, 1), got {watermark}")
        self.name = name
        self.bytes_per_token = bytes_per_token  # for the byte figures of `stats` (0: unknown)
        self.page_tokens = page_tokens
        self.total_pages = total_tokens // page_tokens
        self.watermark_pages = int(self.total_pages * watermark)
        self._free = list(reversed(range(self.total_pages)))  # a stack: page 0 is handed out first
        self._holders = [0] * self.total_pages  # requests whose table holds each page (0: free)
        self._pages: dict[str, list[int]] = {}
        self._lengths: dict[str, int] = {}  # tokens each request holds (for the live-token figures)
        self._handles: dict[str, KVHandle] = {}
        self.refusals = 0
        self.page_refusals = 0
        self.reservations = 0
        self.releases = 0

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def total_tokens(self) -> int:
        return self.total_pages * self.page_tokens

    @property
    def max_request_tokens(self) -> int:
        return self.total_tokens

    @property
    def reserved_tokens(self) -> int:
        return (self.total_pages - self.free_pages) * self.page_tokens

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)

    def _admission_pages(self, req: SizedRequest) -> int:
        return self._pages_for(req.prompt_tokens + 1)  # the prompt and the first generated token

    def initial_tokens(self, req: SizedRequest) -> int:
        return self._admission_pages(req) * self.page_tokens

    def can_admit(self, req: SizedRequest) -> bool:
        return self.free_pages - self._admission_pages(req) >= self.watermark_pages

    def admit(self, req: SizedRequest) -> KVHandle | None:
        return self.admit_sharing(req, None, 0)

    def shareable_tokens(self, tokens: int) -> int:
        """Of `tokens` shared at the front, those that fill whole pages (what `admit_sharing` maps)."""
        return tokens // self.page_tokens * self.page_tokens

    def admit_sharing(self, req: SizedRequest, holder_id: str | None, tokens: int) -> KVHandle | None:
        """Admit `req` with the first `tokens` (whole pages) of its K/V mapped from `holder_id`'s pages; the rest of
        its prompt and its first generated token get fresh pages. None: not enough free pages (nothing changes)."""
        if req.request_id in self._pages:
            raise DuplicateRequestError(f"request {req.request_id} already holds pages")
        shared: list[int] = []
        if holder_id is not None:
            if tokens % self.page_tokens or tokens > self._held(holder_id) * self.page_tokens:
                raise InvalidRequestError(f"cannot share {tokens} tokens of {holder_id!r}: whole pages it holds only")
            shared = self._pages[holder_id][: tokens // self.page_tokens]
        need = max(0, self._admission_pages(req) - len(shared))
        if self.free_pages - need < self.watermark_pages:
            self.refusals += 1
            return None
        for page in shared:
            self._holders[page] += 1
        pages = shared + self._take(need)
        self._pages[req.request_id] = pages
        self._lengths[req.request_id] = req.prompt_tokens
        self.reservations += 1
        handle = self._handles[req.request_id] = KVHandle(req.request_id, len(pages) * self.page_tokens, pages=pages)
        return handle

    def _take(self, n: int) -> list[int]:
        taken = self._free[-n:] if n else []
        del self._free[len(self._free) - n:]
        taken.reverse()
        for page in taken:
            self._holders[page] = 1
        return taken

    def grow(self, request_id: str, new_len: int, *, held: int | None = None) -> Growth | None:
        have = self._held(request_id)
        need = self._pages_for(new_len) - have
        if need <= 0:
            self._lengths[request_id] = max(self._lengths[request_id], new_len)
            return Growth(have * self.page_tokens, 0)
        if need > self.free_pages:
            self.page_refusals += 1
            return None
        self._pages[request_id] += self._take(need)  # the handle's list: the holder sees the new pages
        self._lengths[request_id] = new_len
        self._handles[request_id].capacity = (have + need) * self.page_tokens
        return Growth((have + need) * self.page_tokens, 0)

    def release(self, request_id: str, realized_output: int) -> None:
        pages = self._pages.get(request_id)
        if pages is None:
            raise UnknownRequestError(f"request {request_id!r} holds no pages")
        for page in reversed(pages):
            self._holders[page] -= 1
            if not self._holders[page]:
                self._free.append(page)
        self.releases += 1
        del self._pages[request_id], self._handles[request_id], self._lengths[request_id]

    def evict(self, request_id: str) -> None:
        self.release(request_id, 0)

    def _held(self, request_id: str) -> int:
        pages = self._pages.get(request_id)
        if pages is None:
            raise UnknownRequestError(f"request {request_id!r} holds no pages")
        return len(pages)

    def counters(self) -> dict:
        return {"pool_refusals": self.refusals, "page_refusals": self.page_refusals}

    def load(self, device: str, queued_reserve: int = 0, queued_tokens: int = 0) -> DeviceLoad:
        live = sum(self._lengths.values())
        return DeviceLoad(device, self.total_tokens, self.reserved_tokens + queued_reserve, live + queued_tokens,
                          len(self._pages))

    def stats(self) -> PoolStats:
        """The contiguous pool's snapshot, filled for pages (a page is a block of `page_tokens`; free pages can
        always be had together, so the largest reservable is all of them)."""
        free = self.free_pages * self.page_tokens
        return PoolStats(
            reservations=self.reservations, refusals=self.refusals + self.page_refusals, releases=self.releases,
            total_tokens=self.total_tokens, bytes_per_token=self.bytes_per_token, main_tokens=self.total_tokens,
            large_tokens=0,
            live_blocks=len(self._pages), live_blocks_per_bucket={}, reserved_tokens=self.reserved_tokens,
            live_tokens=sum(self._lengths.values()), free_tokens=free, cached_tokens=0,
            largest_free_extent_tokens=free, largest_reservable_tokens=free, largest_range_tokens=self.total_tokens)

    def check(self) -> None:
        assert 0 <= self.free_pages <= self.total_pages
        held = [p for pages in self._pages.values() for p in pages]
        assert all(self._holders[p] == n for p, n in Counter(held).items()), "a page's holders miscounted"
        assert len(set(held)) + self.free_pages == self.total_pages, "pages not conserved"
        assert len(set(held) | set(self._free)) == self.total_pages, "a page is lost"
        assert not set(held) & set(self._free), "a held page is free"
        assert all(len(set(pages)) == len(pages) for pages in self._pages.values()), "a page twice in one table"
