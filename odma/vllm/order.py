"""The waiting queue in odma's order of service (`odma.engine.ordering`, the engine's own implementation), with
the operations vLLM's scheduler calls (peek, pop, prepend, remove). No vLLM import.

Age is counted in admission rounds (`new_round`), from a request's first arrival: a request put back (preempted,
or skipped this step) keeps its arrival round and its place in arrival order, so being put back never resets its
age. The order is computed once per change of the queue's set or round, not per pop: a pop keeps the rest in order
unless it took the newest request (against which ages are counted) or made the queue shallow.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Iterator

from odma.engine.ordering import ORDERS, ShortestFirst, make_order

__all__ = ["ORDERS", "ShortestFirstQueue"]


class ShortestFirstQueue:
    def __init__(self, remaining: Callable[[Any], float], aging_rounds: int = 256, depth: int = 0) -> None:
        self.order: ShortestFirst = make_order("adaptive" if depth else "sjf", aging_rounds=aging_rounds, depth=depth)
        self._remaining = remaining  # request -> predicted remaining output tokens (inf: no prediction)
        self.round = 0  # admission rounds so far
        self._arrivals = itertools.count()
        self._born: dict[Any, tuple[int, int]] = {}  # request -> (arrival round, arrival order), kept until forgotten
        self._waiting: dict[Any, None] = {}  # the requests queued now
        self._ranked: list[Any] | None = None  # the order of service of _waiting; None: stale
        # kept with _ranked, so that a pop costs no scan: _waiting in arrival order (the oldest last), and the
        # newest arrival round and how many waiting requests arrived in it
        self._arrival: list[Any] = []
        self._newest_round, self._newest_count = 0, 0
        self.reordered = 0  # pops that were not the oldest waiting request (for the metrics)

    # -- vLLM's RequestQueue operations ---------------------------------------------------------------

    def add_request(self, request: Any) -> None:
        """Queued; its place is decided at the next peek (the scheduler tags new requests in one batch first)."""
        if request not in self._born:
            self._born[request] = (self.round, next(self._arrivals))
        self._waiting[request] = None
        self._ranked = None

    def pop_request(self) -> Any:
        request = self.peek_request()
        while self._arrival[-1] not in self._waiting:  # dropped since the order was computed
            self._arrival.pop()
        if not self._shallow() and self._arrival[-1] is not request:
            self.reordered += 1
        del self._waiting[request]
        self._ranked.pop(0)
        newest = self._born[request][0] == self._newest_round
        self._newest_count -= newest
        if (newest and not self._newest_count) or self._shallow():
            self._ranked = None  # ages are counted against another request now, or the order falls back
        return request

    def peek_request(self) -> Any:
        if not self._waiting:
            raise IndexError("peek from an empty queue")
        if self._ranked is None:
            arrival = sorted(self._waiting, key=lambda r: self._born[r][1])
            self._ranked = self.order.rank(arrival, self._waited, self._remaining)
            self._arrival = arrival[::-1]  # the oldest last
            self._newest_round = self._born[arrival[-1]][0]
            self._newest_count = sum(self._born[r][0] == self._newest_round for r in arrival)
        return self._ranked[0]

    def prepend_request(self, request: Any) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Any]) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Any) -> None:
        if request in self._waiting:
            del self._waiting[request]
            self._ranked = None

    def remove_requests(self, requests: Iterable[Any]) -> None:
        for request in requests:
            self.remove_request(request)

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Any]:
        """The order peek/pop would give now (a snapshot)."""
        if self._waiting:
            self.peek_request()
        return iter(list(self._ranked or ()))

    # -- odma's additions ------------------------------------------------------------------------------

    def new_round(self) -> None:
        """An admission round passed (the scheduler admitted someone while others kept waiting)."""
        self.round += 1
        self._ranked = None

    def forget(self, request: Any) -> None:
        """The request finished: its arrival record goes."""
        self.remove_request(request)
        self._born.pop(request, None)

    def waited_rounds(self, request: Any) -> int:
        born = self._born.get(request)
        return 0 if born is None else self.round - born[0]

    # -- internals -------------------------------------------------------------------------------------

    def _waited(self, request: Any) -> int:
        return self.round - self._born[request][0]

    def _shallow(self) -> bool:
        return len(self._waiting) <= self.order.depth
