"""The order of service: which waiting requests an admission round considers first, which one nobody may
overtake, and which running request is preempted when memory runs out.

- `fcfs`: arrival order (a preempted request goes back to the front), except that requests tagged with a bucket
  that just freed a block go first within the round's window (they reuse it from the free list); the newest
  running request is preempted (it loses the least work).
- `sjf`: shortest predicted remaining output first (the predictor's L̂ less what a request has generated, or the
  refined estimate of its remaining length when the engine has one), so short requests do not queue behind
  long ones; the running request with the most predicted work left is preempted. Aging bounds every wait: a
  request that has waited `aging_rounds` admission rounds longer than the newest waiting request goes before
  every request that has not, in arrival order, and once it is first it holds the queue after `max_skips` more
  rounds (nobody overtakes it), like the head of a FCFS queue. Age is counted against the newest arrival, not
  the clock: requests that arrived together age together, so a burst keeps its shortest-first order to the end
  (counted by the clock, the whole burst would turn into arrival order at once `aging_rounds` into it).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from itertools import islice
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from odma.engine.sequence import Sequence

ORDERS = ("fcfs", "sjf")


def predicted_remaining(seq: Sequence) -> float:
    """Output tokens the request is predicted still to generate (inf when it has no prediction)."""
    if seq.predicted_remaining is not None:
        return seq.predicted_remaining
    if seq.predicted_length is None:
        return math.inf
    return max(0.0, seq.predicted_length - seq.num_generated)


class Fcfs:
    name = "fcfs"

    def __init__(self, lookahead: int = 16, max_skips: int = 8) -> None:
        self.lookahead = lookahead  # waiting requests considered per admission round
        self.max_skips = max_skips

    def candidates(self, waiting: deque[Sequence], freed_buckets: Counter) -> list[Sequence]:
        window = list(islice(waiting, self.lookahead))
        if not window or window[0].waited_steps >= self.max_skips or not freed_buckets:
            return window
        return sorted(window, key=lambda s: 0 if freed_buckets.get(s.bucket, 0) > 0 else 1)  # stable: FIFO within

    def head(self, waiting: deque[Sequence]) -> Sequence | None:
        """The request that holds the queue once it has waited `max_skips` rounds."""
        return waiting[0] if waiting else None

    def victim(self, running: list[Sequence]) -> Sequence:
        return running[-1]


class ShortestFirst(Fcfs):
    name = "sjf"

    def __init__(self, lookahead: int = 16, max_skips: int = 8, aging_rounds: int = 256) -> None:
        super().__init__(lookahead, max_skips)
        if aging_rounds < 1:
            raise ValueError(f"aging_rounds must be >= 1, got {aging_rounds}")
        self.aging_rounds = aging_rounds

    def _order(self, waiting: Iterable[Sequence]) -> list[Sequence]:
        # aged requests first, in arrival (queue) order; then by predicted remaining work; ties in queue order
        waiting = list(waiting)
        newest = min((s.waited_steps for s in waiting), default=0)
        return sorted(waiting, key=lambda s: (0, 0.0) if s.waited_steps - newest >= self.aging_rounds
                      else (1, predicted_remaining(s)))

    def candidates(self, waiting: deque[Sequence], freed_buckets: Counter) -> list[Sequence]:
        return self._order(waiting)[: self.lookahead]

    def head(self, waiting: deque[Sequence]) -> Sequence | None:
        return self._order(waiting)[0] if waiting else None

    def victim(self, running: list[Sequence]) -> Sequence:
        # the most predicted work left; among equals the newest (max keeps the first, so scan newest first)
        return max(reversed(running), key=predicted_remaining)


def make_order(name: str, *, lookahead: int = 16, max_skips: int = 8, aging_rounds: int = 256) -> Fcfs:
    if name == "fcfs":
        return Fcfs(lookahead, max_skips)
    if name == "sjf":
        return ShortestFirst(lookahead, max_skips, aging_rounds)
    raise ValueError(f"schedule must be one of {ORDERS}, got {name!r}")
