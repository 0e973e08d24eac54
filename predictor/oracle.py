"""For experiments only: predictors that read the realized length (they cannot exist in serving)."""

from __future__ import annotations

import hashlib
import math
from typing import Any, Sequence

import numpy as np

from odma.errors import PredictorError
from predictor.base import Prediction, Predictor


def _realized(request: Any) -> int:
    n = getattr(request, "output_tokens", None)
    if n is None:
        raise PredictorError("oracle predictors need requests with a realized output_tokens")
    return int(n)


class OraclePredictor(Predictor):
    """L̂ = the realized length, u = 0: the upper bound on what any predictor can give the allocator."""

    name = "oracle"

    def predict(self, requests: Sequence[Any]) -> list[Prediction]:
        return [Prediction(float(_realized(r)), 0.0) for r in requests]


class NoisyOraclePredictor(Predictor):
    """L̂ = realized · exp(N(0, σ²)), deterministic per request id; u = 1 − exp(−|noise|) is honest
    about its own error, so it also exercises the α, τ path."""

    def __init__(self, sigma: float) -> None:
        if not math.isfinite(sigma) or sigma < 0:
            raise PredictorError(f"noisy-oracle sigma must be a finite number >= 0, got {sigma}")
        self.sigma = sigma
        self.name = f"noisy-oracle:{sigma:g}"

    @classmethod
    def from_spec(cls, sigma: str) -> "NoisyOraclePredictor":
        """From the text after `noisy-oracle:` (empty: σ = 0.5)."""
        try:
            return cls(float(sigma) if sigma else 0.5)
        except ValueError:
            raise PredictorError(f"noisy-oracle needs a number, as in noisy-oracle:0.5; got {sigma!r}") from None

    def predict(self, requests: Sequence[Any]) -> list[Prediction]:
        out = []
        for r in requests:
            seed = int.from_bytes(hashlib.sha256(str(getattr(r, "request_id", "")).encode()).digest()[:8], "big")
            noise = float(np.random.default_rng(seed).normal(0.0, self.sigma)) if self.sigma else 0.0
            out.append(Prediction(max(_realized(r), 1) * math.exp(noise), 1.0 - math.exp(-abs(noise))))
        return out
