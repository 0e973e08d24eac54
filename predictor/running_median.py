"""The predictor that needs nothing trained: L̂ = the median realized length of the last requests, u = 1.

It is what a server falls back to when the predictor it was asked for cannot be loaded, and `median` by name. It
learns: every finished request's realized length joins its window (`observe`).
"""

from __future__ import annotations

import operator
import statistics
import threading
from collections import deque
from typing import Any, ClassVar, Sequence

from odma.errors import PredictorError
from predictor.base import Prediction, Predictor


class RunningMedian(Predictor):
    """The median realized length of the last `window` requests (`prior` before any), u = 1.0."""

    name = "running-median"
    learns: ClassVar[bool] = True

    def __init__(self, prior: float = 128.0, window: int = 512) -> None:
        if window < 1:
            raise PredictorError(f"running median: window must be >= 1, got {window}")
        self._lengths: deque[int] = deque(maxlen=window)
        self._prior = prior
        self._lock = threading.Lock()  # the engine's loop observes while a server thread may predict

    def predict(self, requests: Sequence[Any]) -> list[Prediction]:
        with self._lock:
            guess = float(statistics.median(self._lengths)) if self._lengths else self._prior
        return [Prediction(guess, 1.0) for _ in requests]

    def observe(self, request: Any, realized_length: int) -> None:
        """Only the length counts: the median reads nothing of the request."""
        try:
            length = operator.index(realized_length)
        except TypeError:
            length = -1
        if length < 0:
            raise PredictorError(f"realized length must be an integer >= 0, got {realized_length!r}")
        with self._lock:
            self._lengths.append(length)
