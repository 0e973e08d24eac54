"""vLLM's model of KV memory as page-count bookkeeping: fixed-size pages allocated on demand.

Pages are interchangeable, so only counts matter (no fragmentation beyond the last page's tail).
Admission keeps a watermark of free pages back, as vLLM does, so a fresh batch does not preempt at once.
"""

from __future__ import annotations

from odma.errors import DuplicateRequestError, InvalidRequestError, UnknownRequestError
from odma.kv.blocks import Growth, KVHandle
from odma.kv.manager import KVManager
from odma.kv.policy import SizedRequest


class PagedKV(KVManager):
    def __init__(self, total_tokens: int, page_tokens: int = 16, watermark: float = 0.01, name: str = "paged") -> None:
        if page_tokens < 1 or total_tokens < page_tokens:
            raise InvalidRequestError(f"a paged pool of {total_tokens} tokens cannot hold one {page_tokens}-token page")
        if not 0.0 <= watermark < 1.0:
            raise InvalidRequestError(f"watermark must be in [0, 1), got {watermark}")
        self.name = name
        self.page_tokens = page_tokens
        self.total_pages = total_tokens // page_tokens
        self.watermark_pages = int(self.total_pages * watermark)
        self.free_pages = self.total_pages
        self._pages: dict[str, int] = {}
        self._handles: dict[str, KVHandle] = {}
        self.refusals = 0
        self.page_refusals = 0

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
        if req.request_id in self._pages:
            raise DuplicateRequestError(f"request {req.request_id} already holds pages")
        need = self._admission_pages(req)
        if self.free_pages - need < self.watermark_pages:
            self.refusals += 1
            return None
        self.free_pages -= need
        self._pages[req.request_id] = need
        handle = self._handles[req.request_id] = KVHandle(req.request_id, need * self.page_tokens)
        return handle

    def grow(self, request_id: str, new_len: int, *, held: int | None = None) -> Growth | None:
        have = self._held(request_id)
        need = self._pages_for(new_len) - have
        if need <= 0:
            return Growth(have * self.page_tokens, 0)
        if need > self.free_pages:
            self.page_refusals += 1
            return None
        self.free_pages -= need
        self._pages[request_id] = have + need
        self._handles[request_id].capacity = (have + need) * self.page_tokens
        return Growth((have + need) * self.page_tokens, 0)

    def release(self, request_id: str, realized_output: int) -> None:
        self.free_pages += self._held(request_id)
        del self._pages[request_id], self._handles[request_id]

    def evict(self, request_id: str) -> None:
        self.release(request_id, 0)

    def _held(self, request_id: str) -> int:
        pages = self._pages.get(request_id)
        if pages is None:
            raise UnknownRequestError(f"request {request_id!r} holds no pages")
        return pages

    def counters(self) -> dict:
        return {"pool_refusals": self.refusals, "page_refusals": self.page_refusals}

    def check(self) -> None:
        assert 0 <= self.free_pages <= self.total_pages
        assert self.free_pages + sum(self._pages.values()) == self.total_pages, "pages not conserved"
