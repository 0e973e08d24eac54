"""Admission rules: whether one more waiting request may start beside the running ones, asked by the scheduler
after its memory, prefill budget and running cap agreed. Each rule is a small object; the scheduler asks them in
turn (all must agree) and counts a refusal under the rule's counter. Rules apply only while something runs: an
idle engine admits, so no rule can keep a lone request from ever running.

- `ReservedShare(θ)`: eLLM's Algorithm 1 threshold: a new request is admitted only while reservations stay within
  θ of the pool, keeping 1 − θ for running requests to grow into. Reservations are all-or-nothing (a block or
  none), so there is no hold-and-wait; offloading others to let a prefill in is what swap preemption does on the
  growth path.
- `PredictedDemand(S)`: a new request is admitted only while the KV the running requests are predicted to hold
  when they finish (prompt + L̂, capped at max_tokens), plus its own, stays within the share S of the pool.
  Reservations start small and grow, so the pool alone admits more requests than it can finish without
  preempting; this caps the batch where memory runs out instead of at a fixed count. Only the sum counts, and
  errors of single predictions average out in it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable, Protocol

from odma.engine.ordering import predicted_remaining

if TYPE_CHECKING:
    from odma.engine.sequence import Sequence
    from odma.kv import KVManager


class AdmissionRule(Protocol):
    counter: str  # the SchedulerCounters field that counts this rule's refusals

    def begin_round(self, running: list[Sequence], kv: KVManager) -> None:
        """An admission round starts with `running` running."""

    def allows(self, seq: Sequence, kv: KVManager) -> bool:
        """May `seq` start now?"""

    def admitted(self, seq: Sequence) -> None:
        """`seq` started in this round."""


class ReservedShare:
    counter = "theta_refusals"

    def __init__(self, theta: float) -> None:
        if not 0 < theta <= 1:
            raise ValueError(f"admission_theta must be in (0, 1], got {theta}")
        self.theta = theta

    def begin_round(self, running: list[Sequence], kv: KVManager) -> None:
        pass

    def allows(self, seq: Sequence, kv: KVManager) -> bool:
        return kv.reserved_tokens + kv.initial_tokens(seq) <= self.theta * kv.capacity_tokens

    def admitted(self, seq: Sequence) -> None:
        pass


class PredictedDemand:
    counter = "demand_refusals"

    def __init__(self, share: float) -> None:
        if not (share > 0 and math.isfinite(share)):
            raise ValueError(f"admission_demand must be a positive share of the pool, got {share}")
        self.share = share
        self._demand = 0  # predicted final tokens of the running requests and those admitted this round

    def begin_round(self, running: list[Sequence], kv: KVManager) -> None:
        self._demand = sum(final_tokens(s) for s in running)

    def allows(self, seq: Sequence, kv: KVManager) -> bool:
        return self._demand + final_tokens(seq) <= self.share * kv.capacity_tokens

    def admitted(self, seq: Sequence) -> None:
        self._demand += final_tokens(seq)


def final_tokens(seq: Sequence) -> int:
    """Tokens `seq` is predicted to hold when it finishes: what it holds now plus its predicted remaining output,
    within its max_tokens (the whole max_tokens when it has no prediction)."""
    limit = len(seq.prompt_ids) + seq.params.max_tokens
    remaining = predicted_remaining(seq)
    if math.isinf(remaining):
        return limit
    return min(limit, seq.num_tokens + math.ceil(remaining))


def admission_rules(theta: float = 1.0, demand: float | None = None) -> list[AdmissionRule]:
    """The rules the engine's settings ask for (`--admission-theta`, `--admission-demand`); none by default."""
    rules: list[AdmissionRule] = []
    if theta != 1.0:  # θ = 1 admits whatever the pool holds: no rule (any other value is checked by the rule)
        rules.append(ReservedShare(theta))
    if demand is not None:
        rules.append(PredictedDemand(demand))
    return rules


def first_refusal(rules: Iterable[AdmissionRule], seq: Sequence, kv: KVManager) -> AdmissionRule | None:
    return next((rule for rule in rules if not rule.allows(seq, kv)), None)
