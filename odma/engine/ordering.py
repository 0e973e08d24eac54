"""The order of service, one implementation for every scheduler that serves a queue (the engine's `Scheduler`, and
odma's vLLM plugin through `odma.vllm.order`): which waiting requests an admission round considers first, which one
nobody may overtake, and which running request is preempted when memory runs out.

- `fcfs`: arrival order (a preempted request goes back to the front), except that requests tagged with a bucket
  that just freed a block go first within the round's window (they reuse it from the free list); the newest
  running request is preempted (it loses the least work).
- `sjf`: shortest predicted remaining output first (the predictor's L̂ less what a request has generated, or the
  refined estimate of its remaining length when the engine has one), so short requests do not queue behind
  long ones; the running request with the most predicted work left is preempted. Aging bounds every wait: a
  request that has waited `aging_rounds` admission rounds longer than the newest waiting request goes before
  every request that has not, in queue order, and once it is first it holds the queue after `max_skips` more
  rounds (nobody overtakes it), like the head of a FCFS queue. Age is counted against the newest arrival, not
  the clock: requests that arrived together age together, so a burst keeps its shortest-first order to the end
  (counted by the clock, the whole burst would turn into arrival order at once `aging_rounds` into it).
- `adaptive`: sjf only while more requests wait than `depth` (the running cap); a shallow queue is served in queue
  order, because everyone in it starts within about one service time anyway and reordering it buys little mean
  latency for its cost in fairness.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from itertools import islice
from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:
    from odma.engine.sequence import Sequence

ORDERS = ("fcfs", "sjf", "adaptive")


def predicted_remaining(seq: Sequence) -> float:
    """Output tokens the request is predicted still to generate (inf when it has no prediction)."""
    if seq.predicted_remaining is not None:
        return seq.predicted_remaining
    if seq.predicted_length is None:
        return math.inf
    return max(0.0, seq.predicted_length - seq.num_generated)


def _waited_steps(seq: Sequence) -> int:
    return seq.waited_steps


class Fcfs:
    name = "fcfs"

    def __init__(self, lookahead: int = 16, max_skips: int = 8) -> None:
        self.lookahead = lookahead  # waiting requests considered per admission round
        self.max_skips = max_skips

    def rank(self, waiting: Iterable[Any], waited: Callable[[Any], int] = _waited_steps,
             remaining: Callable[[Any], float] = predicted_remaining) -> list[Any]:
        """`waiting` (in queue order) in the order of service; `waited(r)`: admission rounds r has waited,
        `remaining(r)`: its predicted remaining output (inf: unknown)."""
        return list(waiting)

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

    def __init__(self, lookahead: int = 16, max_skips: int = 8, aging_rounds: int = 256, depth: int = 0) -> None:
        super().__init__(lookahead, max_skips)
        if aging_rounds < 1:
            raise ValueError(f"aging_rounds must be >= 1, got {aging_rounds}")
        self.aging_rounds = aging_rounds
        self.depth = depth  # shortest first only while more than this many wait (0: always)

    def rank(self, waiting: Iterable[Any], waited: Callable[[Any], int] = _waited_steps,
             remaining: Callable[[Any], float] = predicted_remaining) -> list[Any]:
        # aged requests first, in queue order; then by predicted remaining work; ties in queue order
        waiting = list(waiting)
        if len(waiting) <= self.depth:
            return waiting
        ages = [waited(r) for r in waiting]
        newest = min(ages, default=0)

        def key(i: int) -> tuple[int, float]:
            if ages[i] - newest >= self.aging_rounds:
                return 0, 0.0
            left = remaining(waiting[i])
            return 1, left if left >= 0 else math.inf  # NaN or negative: unknown

        return [waiting[i] for i in sorted(range(len(waiting)), key=key)]

    def candidates(self, waiting: deque[Sequence], freed_buckets: Counter) -> list[Sequence]:
        return self.rank(waiting)[: self.lookahead]

    def head(self, waiting: deque[Sequence]) -> Sequence | None:
        return self.rank(waiting)[0] if waiting else None

    def victim(self, running: list[Sequence]) -> Sequence:
        # the most predicted work left; among equals the newest (max keeps the first, so scan newest first)
        return max(reversed(running), key=predicted_remaining)


def make_order(name: str, *, lookahead: int = 16, max_skips: int = 8, aging_rounds: int = 256,
               depth: int = 0) -> Fcfs:
    """`depth`: adaptive's threshold (the running cap): shortest first only while more than this many wait."""
    if name == "fcfs":
        return Fcfs(lookahead, max_skips)
    if name == "sjf":
        return ShortestFirst(lookahead, max_skips, aging_rounds)
    if name == "adaptive":
        return ShortestFirst(lookahead, max_skips, aging_rounds, depth=depth)
    raise ValueError(f"schedule must be one of {ORDERS}, got {name!r}")
