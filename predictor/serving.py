"""A length predictor as a server runs it: predict a batch, keep the usable answers, let the rest fall back to the
worst case, and tell the predictor what each finished request realized.

Every place that serves a predictor (the engine's tagger, odma's scheduler inside vLLM, the Ray ingress) drives it
through `ServedPredictor`, so a prediction is judged usable, a failure falls back and a learner learns the same
way everywhere. Nothing a predictor returns or raises leaves here as an exception: serving goes on without it.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Sequence

from predictor.base import Prediction

log = logging.getLogger(__name__)


def usable_prediction(answer: Any) -> Prediction | None:
    """(L̂, u) when a predictor's answer can size a reservation: L̂ finite and >= 0, u finite (clamped to
    [0, 1]); None otherwise (NaN from an overflowing input, a failed call), and the request reserves for
    the worst case."""
    try:
        length, u = float(answer[0]), float(answer[1])
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if not (math.isfinite(length) and length >= 0 and math.isfinite(u)):
        return None
    return Prediction(length, min(max(u, 0.0), 1.0))


def _abstains(answer: Any) -> bool:
    """No prediction given (None, or no L̂), as opposed to a wrong one: not counted as rejected."""
    if answer is None:
        return True
    try:
        return answer[0] is None
    except (TypeError, IndexError, KeyError):
        return False


class ServedPredictor:
    """predict → usable → fallback, and observe on finish, around one predictor (anything with `predict`; the
    `predictor.base.Predictor` protocol adds `observe` and what it declares).

    `on_call(seconds, requests)` is told of every call to the predictor, failed or not (latency metrics)."""

    def __init__(self, predictor: Any, on_call: Callable[[float, int], None] | None = None) -> None:
        self.predictor = predictor  # replaceable: the next call uses the new one
        self.on_call = on_call
        self.rejected = 0  # answers that came back unusable (not finite, negative, malformed)
        self.failed_calls = 0  # calls that raised or answered the wrong number of requests
        self.learn_failures = 0  # observe() calls that raised

    @property
    def learns(self) -> bool:
        """Whether the predictor declares that finished requests change its later predictions."""
        return bool(getattr(self.predictor, "learns", False))

    def predict(self, requests: Sequence[Any], names: Sequence[str] | None = None) -> list[Prediction | None]:
        """One usable (L̂, u) or None per request, in order, from one call. A call that raises or answers the wrong
        number of requests gives None for all of them; an unusable answer gives None for its request (counted in
        `rejected` and logged under its name from `names`). None means: reserve for the worst case."""
        if not requests:
            return []
        started = time.perf_counter()
        try:
            answers = list(self.predictor.predict(requests))
            if len(answers) != len(requests):
                raise ValueError(f"{len(answers)} predictions for {len(requests)} requests")
        except Exception:  # noqa: BLE001 - a failing predictor must not lose requests: reserve for the worst case
            self.failed_calls += 1
            log.exception("length predictor failed; these %d requests reserve for the worst case", len(requests))
            answers = [None] * len(requests)
        if self.on_call is not None:
            self.on_call(time.perf_counter() - started, len(requests))
        names = names if names is not None else [None] * len(requests)
        return [self.usable(answer, name) for answer, name in zip(answers, names)]

    def usable(self, answer: Any, name: str | None = None) -> Prediction | None:
        """`usable_prediction(answer)`, counting and logging an answer that came back unusable (a prediction made
        elsewhere, e.g. at a cluster's router, is judged here too)."""
        checked = usable_prediction(answer)
        if checked is None and not _abstains(answer):
            self.rejected += 1
            log.warning("length predictor returned %r for %s; it reserves for the worst case", answer,
                        name or "a request")
        return checked

    def observe(self, request: Any, realized_length: int) -> None:
        """A request finished with `realized_length` output tokens: a predictor that learns is told, with the
        request as it was given to `predict`. Learning is best effort: a failure is logged and counted."""
        if not self.learns:
            return  # a predictor that does not learn has nothing to do with it (its observe is a no-op)
        try:
            self.predictor.observe(request, realized_length)
        except Exception:  # noqa: BLE001 - learning must not fail a step
            self.learn_failures += 1
            log.exception("length predictor refused a finished request's length %r", realized_length)
