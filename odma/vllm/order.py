"""The waiting queue in length-aware order (no vLLM): odma's shortest-predicted-first with aging, as a queue with
the operations vLLM's scheduler calls (peek, pop, prepend, remove).

- `sjf`: the least predicted remaining output first (ties in arrival order). Aging bounds every wait: a request
  that arrived `aging_rounds` admission rounds before the newest waiting request goes before every request that
  did not, in arrival order. Age is counted against the newest arrival, not the clock: requests that arrived
  together age together, so a burst keeps its shortest-first order to the end (counted by the clock, the whole
  burst would turn into arrival order at once `aging_rounds` into it).
- `adaptive`: sjf only while more requests wait than `depth` (the running cap); a shallow queue is served in
  arrival order, because everyone in it starts within about one service time anyway and reordering it buys
  little mean latency for its cost in fairness.

A request put back (preempted, or skipped this step) keeps its arrival round, so being put back never resets its
age. Removal is lazy: stale heap entries are dropped when they reach the top.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from typing import Any, Callable, Iterable, Iterator

ORDERS = ("fcfs", "sjf", "adaptive")


class ShortestFirstQueue:
    def __init__(self, remaining: Callable[[Any], float], aging_rounds: int = 256, depth: int = 0) -> None:
        if aging_rounds < 1:
            raise ValueError(f"aging_rounds must be >= 1, got {aging_rounds}")
        self._remaining = remaining  # request -> predicted remaining output tokens (inf: no prediction)
        self.aging_rounds = aging_rounds
        self.depth = depth  # sjf only while more than this many wait (0: always)
        self.round = 0  # admission rounds so far
        self._seq = itertools.count()
        self._entry: dict[Any, int] = {}  # request -> its live entry's sequence number
        self._born: dict[Any, tuple[int, int]] = {}  # request -> (arrival round, arrival order), kept until forgotten
        self._heap: list[tuple[float, int, int, Any]] = []  # (remaining, arrival order, entry, request)
        self._young: deque[tuple[int, int, Any]] = deque()  # (arrival round, entry, request) in arrival order
        self._aged: list[tuple[int, int, Any]] = []  # (arrival order, entry, request): a heap, oldest first
        self._aged_entries: set[int] = set()
        self._pending: list[Any] = []  # queued since the last peek, not placed yet
        self.reordered = 0  # pops that were not the oldest waiting request (for the metrics)

    # -- vLLM's RequestQueue operations ---------------------------------------------------------------

    def add_request(self, request: Any) -> None:
        """Queued as it is; its place is decided at the next peek (the scheduler tags new requests in one batch
        first)."""
        self._pending.append(request)

    def _flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            for request in pending:
                self._push(request)

    def _push(self, request: Any) -> None:
        born = self._born.get(request)
        if born is None:
            born = self._born[request] = (self.round, next(self._seq))
        entry = next(self._seq)
        self._entry[request] = entry
        remaining = self._remaining(request)
        if not (remaining >= 0):  # NaN or negative: treat as unknown
            remaining = math.inf
        heapq.heappush(self._heap, (remaining, born[1], entry, request))
        # a put-back request may be older than the youngest queued one: keep _young in arrival order (whether it
        # is aged is decided at the next peek, against the newest request waiting then)
        if self._young and self._young[-1][0] > born[0]:
            self._young = deque(sorted([*self._young, (born[0], entry, request)], key=lambda t: t[0]))
        else:
            self._young.append((born[0], entry, request))

    def pop_request(self) -> Any:
        request = self.peek_request()
        if not self._shallow() and self._oldest() is not request:
            self.reordered += 1
        del self._entry[request]
        return request

    def peek_request(self) -> Any:
        self._flush()
        if not self._entry:
            raise IndexError("peek from an empty queue")
        if self._shallow():
            return self._oldest()
        self._promote()
        while self._aged:
            order, entry, request = self._aged[0]
            if self._entry.get(request) == entry:
                return request
            heapq.heappop(self._aged)
            self._aged_entries.discard(entry)
        while True:
            _, _, entry, request = self._heap[0]
            if self._entry.get(request) == entry and entry not in self._aged_entries:
                return request
            heapq.heappop(self._heap)

    def prepend_request(self, request: Any) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Any]) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Any) -> None:
        self._flush()
        self._entry.pop(request, None)

    def remove_requests(self, requests: Iterable[Any]) -> None:
        self._flush()
        for request in requests:
            self._entry.pop(request, None)

    def __bool__(self) -> bool:
        return bool(self._entry) or bool(self._pending)

    def __len__(self) -> int:
        return len(self._entry) + len(self._pending)

    def __iter__(self) -> Iterator[Any]:
        """The order peek/pop would give now (a snapshot)."""
        self._flush()
        if self._shallow():
            return iter(sorted(self._entry, key=lambda r: self._born[r][1]))
        self._promote()
        aged = sorted((t for t in self._aged if self._entry.get(t[2]) == t[1]), key=lambda t: t[0])
        rest = sorted((t for t in self._heap if self._entry.get(t[3]) == t[2] and t[2] not in self._aged_entries),
                      key=lambda t: (t[0], t[1]))
        return iter([t[2] for t in aged] + [t[3] for t in rest])

    # -- odma's additions ------------------------------------------------------------------------------

    def new_round(self) -> None:
        """An admission round passed (the scheduler admitted someone while others kept waiting)."""
        self.round += 1

    def forget(self, request: Any) -> None:
        """The request finished: its arrival record goes."""
        self._flush()
        self._entry.pop(request, None)
        self._born.pop(request, None)

    def waited_rounds(self, request: Any) -> int:
        born = self._born.get(request)
        return 0 if born is None else self.round - born[0]

    # -- internals -------------------------------------------------------------------------------------

    def _shallow(self) -> bool:
        return len(self._entry) <= self.depth

    def _oldest(self) -> Any:
        return min(self._entry, key=lambda r: self._born[r][1])

    def _age(self, order: int, entry: int, request: Any) -> None:
        heapq.heappush(self._aged, (order, entry, request))
        self._aged_entries.add(entry)

    def _promote(self) -> None:
        young = self._young
        # stale ends (requests popped or removed since) go, so that young[-1] is the newest waiting request
        while young and self._entry.get(young[-1][2]) != young[-1][1]:
            young.pop()
        while young and young[-1][0] - young[0][0] >= self.aging_rounds:
            born_round, entry, request = young.popleft()
            if self._entry.get(request) == entry:
                self._age(self._born[request][1], entry, request)
        while young and self._entry.get(young[0][2]) != young[0][1]:
            young.popleft()
