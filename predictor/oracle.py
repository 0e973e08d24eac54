"""For experiments only: predictors that read the realized length (they cannot exist in serving)."""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
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


class PromptOraclePredictor(Predictor):
    """L̂ = the mean realized length of the OTHER answers to the same prompt in the batch, u = 0: a predictor that
    knows each prompt's length distribution (its sampling noise included) but not which draw this request will
    be — the ceiling of any prompt-time predictor. From K answers per prompt the leave-one-out mean of K−1 draws
    slightly underestimates that ceiling; `with_own` (spec `prompt-oracle:with-own`) averages all K, this draw
    included, and slightly overestimates it. Needs several answers per prompt in one `predict` call (a
    multi-sample trace); a prompt answered once gets the mean of every other answer in the batch."""

    def __init__(self, with_own: bool = False) -> None:
        self.with_own = with_own
        self.name = "prompt-oracle:with-own" if with_own else "prompt-oracle"

    @classmethod
    def from_spec(cls, arg: str) -> "PromptOraclePredictor":
        if arg not in ("", "with-own"):
            raise PredictorError(f"prompt-oracle takes nothing or ':with-own', got {arg!r}")
        return cls(with_own=arg == "with-own")

    def predict(self, requests: Sequence[Any]) -> list[Prediction]:
        lengths = [_realized(r) for r in requests]
        prompts = [str(getattr(r, "prompt", "")) for r in requests]
        sums: dict[str, int] = defaultdict(int)
        counts: dict[str, int] = defaultdict(int)
        for prompt, n in zip(prompts, lengths):
            sums[prompt] += n
            counts[prompt] += 1
        total, count = sum(lengths), len(lengths)
        own = 0 if self.with_own else 1  # how many of the prompt's draws are left out: this one, or none
        out = []
        for prompt, n in zip(prompts, lengths):
            if counts[prompt] - own > 0:
                out.append(Prediction((sums[prompt] - own * n) / (counts[prompt] - own), 0.0))
            elif count > 1:
                out.append(Prediction((total - n) / (count - 1), 0.0))
            else:
                raise PredictorError("prompt-oracle needs more than one request in a batch")
        return out
