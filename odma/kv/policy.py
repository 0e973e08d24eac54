"""Reservation policies: how many output tokens a request reserves, and what it grows into (no torch).

The pool asks a policy; the policy never touches memory. Capacity = prompt tokens + reserved output.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Protocol, Sequence

from odma.config import GROWTH_POLICIES, BucketConfig, PoolConfig
from odma.errors import ConfigError, InvalidRequestError
from odma.kv.buckets import LARGE, BucketChoice, BucketManager, equal_width_bounds


class SizedRequest(Protocol):
    request_id: str
    prompt_tokens: int
    max_new_tokens: int
    predicted_tokens: float | None
    uncertainty: float
    # optional: growth_hint, output tokens the next growth should hold (see _grow_by)


@dataclass(slots=True)
class KVRequest:
    """What the pool needs to know about a request (the engine's sequence may carry the same fields)."""

    request_id: str
    prompt_tokens: int
    max_new_tokens: int
    predicted_tokens: float | None = None
    uncertainty: float = 0.0
    growth_hint: float | None = None  # output tokens the next growth should hold (see _grow_by)


@dataclass(frozen=True, slots=True)
class Reservation:
    output_tokens: int  # output tokens reserved beyond the prompt
    bucket: int  # bucket index, LARGE for the large bucket


class ReservationPolicy(ABC):
    name: str = "policy"

    @abstractmethod
    def initial(self, req: SizedRequest) -> Reservation:
        """The reservation before the first token."""

    @abstractmethod
    def grow(self, req: SizedRequest, needed_output: int, current: Reservation) -> Reservation:
        """The reservation to migrate to once `needed_output` tokens no longer fit in `current`."""

    def initial_tokens(self, req: SizedRequest) -> int:
        """Tokens the first block holds: the prompt plus the initial output reservation (before alignment)."""
        return req.prompt_tokens + self.initial(req).output_tokens

    @property
    def version(self) -> int:
        """Changes when bucket bounds change (the pool drops its cached free blocks then)."""
        return 0

    def observe(self, realized_len: int) -> None:
        """A request finished with this many output tokens."""


def _grow_by(growth: str, req: SizedRequest, needed: int, current: Reservation, buckets: BucketManager | None,
             step: int = 0):
    cap = req.max_new_tokens
    # a request may say how much output it will need in all (the engine's refined prediction of its remaining
    # length): one growth straight to that, instead of one bucket at a time
    hint = getattr(req, "growth_hint", None)
    if hint is not None and hint > needed:
        needed = min(cap, math.ceil(hint))
    if growth == "large" or buckets is None and growth == "next":
        return Reservation(cap, LARGE)
    if growth == "double":
        return Reservation(min(cap, max(needed, 2 * current.output_tokens)), current.bucket)
    if growth == "step":  # a few tokens beyond the need: little held unused, and a small range to find
        return Reservation(min(cap, needed + step), current.bucket)
    choice = buckets.next_above(needed)
    return Reservation(min(cap, choice.bound), choice.index)


class StaticPolicy(ReservationPolicy):
    """Worst case: prompt + max_new_tokens. Never grows (the Cambricon-vLLM baseline)."""

    name = "static"

    def initial(self, req: SizedRequest) -> Reservation:
        return Reservation(req.max_new_tokens, 0)

    def grow(self, req: SizedRequest, needed_output: int, current: Reservation) -> Reservation:
        return Reservation(req.max_new_tokens, current.bucket)


class BucketPolicy(ReservationPolicy):
    """Predicted length → bucket (dynamic quantile buckets for odma, static equal-width ones for S3)."""

    def __init__(
        self, buckets: BucketManager, growth: str = "next", name: str = "odma", reserve_scale: float = 1.0,
        growth_step: int = PoolConfig().growth_step,
    ) -> None:
        if growth not in GROWTH_POLICIES:
            raise ConfigError(f"growth must be one of {GROWTH_POLICIES}, got {growth!r}")
        if type(growth_step) is not int or growth_step < 1:
            raise ConfigError(f"growth_step must be a whole number of tokens >= 1, got {growth_step!r}")
        if not (0 < reserve_scale < math.inf):
            raise ConfigError(f"reserve_scale must be a positive number, got {reserve_scale}")
        self.buckets = buckets
        self.growth = growth
        self.name = name
        # < 1: reserve for part of L̂ and grow by migration (cheap contiguous copies) when it is exceeded
        self.reserve_scale = reserve_scale
        self.growth_step = growth_step  # output tokens beyond the need that growth "step" reserves
        self._reservations: dict[BucketChoice, Reservation] = {}

    def initial(self, req: SizedRequest) -> Reservation:
        if req.predicted_tokens is None:  # no prediction: only the large bucket is safe
            return Reservation(req.max_new_tokens, LARGE)
        choice = self.select(req.predicted_tokens, req.uncertainty)
        if choice.bound <= req.max_new_tokens:  # the common case: one shared object per bucket choice
            res = self._reservations.get(choice)
            if res is None:
                res = self._reservations[choice] = Reservation(choice.bound, choice.index)
                if len(self._reservations) > 1024:  # bounds drift: keep the cache small
                    self._reservations.clear()
            return res
        return Reservation(req.max_new_tokens, choice.index)

    def select(self, predicted_tokens: float, uncertainty: float) -> BucketChoice:
        """The bucket a prediction reserves (reserve_scale applied): what `initial` uses, and a scheduling tag."""
        return self.buckets.select(predicted_tokens * self.reserve_scale, uncertainty)

    def grow(self, req: SizedRequest, needed_output: int, current: Reservation) -> Reservation:
        return _grow_by(self.growth, req, needed_output, current, self.buckets, self.growth_step)

    @property
    def version(self) -> int:
        return self.buckets.version

    def observe(self, realized_len: int) -> None:
        self.buckets.observe(realized_len)


class ExactPolicy(ReservationPolicy):
    """Reserve exactly the predicted length (the contiguous upper bound when the prediction is the truth)."""

    name = "exact"

    def __init__(self, growth: str = "double", min_tokens: int = 1) -> None:
        if growth not in ("double", "large"):
            raise ConfigError(f"exact reservation grows by 'double' or 'large', got {growth!r}")
        self.growth = growth
        self.min_tokens = min_tokens

    def initial(self, req: SizedRequest) -> Reservation:
        predicted = req.predicted_tokens
        if predicted is None:
            return Reservation(req.max_new_tokens, LARGE)
        return Reservation(min(req.max_new_tokens, max(self.min_tokens, math.ceil(predicted))), 0)

    def grow(self, req: SizedRequest, needed_output: int, current: Reservation) -> Reservation:
        return _grow_by(self.growth, req, needed_output, current, None)


POLICY_KINDS = ("odma", "static", "s3")


def build_policy(kind: str, *, max_tokens: int, buckets: BucketConfig, pool: PoolConfig, s3_buckets: int = 8,
                 bootstrap: Sequence[int] | None = None) -> ReservationPolicy:
    """The serving policy named `kind`. odma: dynamic buckets refreshed from realized lengths (seeded with
    `bootstrap`), reserve_scale·L̂ and growth; s3: static equal-width buckets; static: prompt + max_tokens for
    every request. All share the same pool and budget; the large bucket holds the largest max_tokens."""
    if kind == "static":
        return StaticPolicy()
    if kind == "s3":
        fixed = BucketManager.fixed(equal_width_bounds(max_tokens, s3_buckets), max_tokens)
        return BucketPolicy(fixed, growth=pool.growth, name="s3", growth_step=pool.growth_step)
    if kind != "odma":
        raise ConfigError(f"policy must be one of {POLICY_KINDS}, got {kind!r}")
    return BucketPolicy(BucketManager(replace(buckets, large_bound=max_tokens), bootstrap=bootstrap or None),
                        growth=pool.growth, name="odma", reserve_scale=pool.reserve_scale, growth_step=pool.growth_step)


def _is_count(v, low: int) -> bool:
    return type(v) is int and v >= low  # bool is a subclass of int: `type(...) is int` rejects it


def _is_nonneg_number(v) -> bool:
    return (type(v) is float or type(v) is int) and 0 <= v < math.inf  # NaN fails both comparisons


def validate_request(req: SizedRequest) -> None:
    """Reject malformed requests before any state changes (on the hot path: one expression when valid)."""
    rid = getattr(req, "request_id", None)
    p, m, pred, u = req.prompt_tokens, req.max_new_tokens, req.predicted_tokens, req.uncertainty
    if (
        type(rid) is str and rid and type(p) is int and p >= 1 and type(m) is int and m >= 1
        and (pred is None or (type(pred) is float or type(pred) is int) and 0 <= pred < math.inf)
        and (type(u) is float or type(u) is int) and 0 <= u < math.inf
    ):
        return
    if type(rid) is not str or not rid:
        raise InvalidRequestError(f"request_id must be a non-empty string, got {rid!r}")
    if not _is_count(p, 1):
        raise InvalidRequestError(f"request {rid}: prompt_tokens must be an integer >= 1, got {p!r}")
    if not _is_count(m, 1):
        raise InvalidRequestError(f"request {rid}: max_new_tokens must be an integer >= 1, got {m!r}")
    if pred is not None and not _is_nonneg_number(pred):
        raise InvalidRequestError(f"request {rid}: predicted_tokens must be a finite number >= 0, got {pred!r}")
    raise InvalidRequestError(f"request {rid}: uncertainty must be a finite number >= 0, got {u!r}")
