"""Cheap request metadata → a fixed-size float vector; every field may be absent.

Layout: log prompt length (always known), then a presence flag and a value for each numeric field, then a
one-hot block per categorical field over the values seen in training (all zeros when absent or unseen).
Absent metadata is therefore an all-zero block, which training also shows the model (metadata dropout), so a
request without metadata is in-distribution rather than a surprise.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from odma.errors import PredictorError

CATEGORICAL_FIELDS = ("type", "system_prompt_id", "generator")
# Numeric fields. A predictor saves its list and scale; older ones (without those keys) had the first two
# fields and divided log lengths by 8. Plain log units won: next to 384 layer-normalized embedding
# dimensions, a length feature squeezed to [0, 1.5] was under-used (docs/predictor.md).
NUMERIC_FIELDS = ("temperature", "depth", "prior_output_tokens", "last_output_tokens")
LEGACY_NUMERIC_FIELDS = ("temperature", "depth")
LEGACY_LOG_LENGTH_SCALE = 8.0


# Inputs are clamped to these ranges, so that no request can overflow float32 (a temperature of 1e39 became inf
# and L̂ NaN): temperatures beyond OpenAI's [0, 2], log lengths of more than 1e13 tokens mean nothing anyway.
TEMPERATURE_RANGE = (0.0, 2.0)
MAX_LOG_VALUE = 30.0


def _numeric_value(name: str, value: Any, log_length_scale: float) -> float | None:
    """The feature value, or None when the value is unusable (not a number, NaN): it counts as absent."""
    try:
        if name == "temperature":
            x = float(value)
            return None if math.isnan(x) else min(max(x, TEMPERATURE_RANGE[0]), TEMPERATURE_RANGE[1])
        if name == "depth":
            x = math.log1p(max(float(value), 0.0))
        else:  # the lengths of the conversation's earlier replies (mean, latest): the strongest cue a later turn carries
            x = math.log1p(max(float(value), 0.0)) / log_length_scale
    except (TypeError, ValueError, OverflowError):
        return None
    return None if math.isnan(x) else min(x, MAX_LOG_VALUE)


def prompt_tokens_of(request: Any) -> int:
    n = getattr(request, "prompt_tokens", None)
    if n is None:  # no count given: a rough estimate beats nothing
        return len(getattr(request, "prompt", None) or "") // 4
    return int(n)


@dataclass(frozen=True)
class MetadataEncoder:
    """Knows which categorical values it saw in training; `size` is fixed once fitted."""

    vocab: dict[str, list[str]] = field(default_factory=dict)
    numeric: tuple[str, ...] = NUMERIC_FIELDS
    log_length_scale: float = 1.0  # log1p(tokens) / this, for the prompt length and earlier replies

    @classmethod
    def fit(cls, requests: Sequence[Any], min_count: int = 5, max_values: int = 16) -> "MetadataEncoder":
        vocab = {}
        for name in CATEGORICAL_FIELDS:
            counts = Counter(v for r in requests if (v := getattr(r, name, None)) is not None)
            common = [v for v, c in counts.most_common(max_values) if c >= min_count]
            # One value seen everywhere carries no signal inside this trace; keep it only if mixed.
            if len(common) >= 2 or (common and sum(counts.values()) < len(requests)):
                vocab[name] = sorted(common)
        return cls(vocab, NUMERIC_FIELDS, 1.0)

    @property
    def size(self) -> int:
        return 1 + 2 * len(self.numeric) + sum(len(v) for v in self.vocab.values())

    def encode(self, requests: Sequence[Any]) -> np.ndarray:
        out = np.zeros((len(requests), self.size), dtype=np.float32)
        for i, r in enumerate(requests):
            out[i, 0] = math.log1p(max(prompt_tokens_of(r), 0)) / self.log_length_scale
            col = 1
            for name in self.numeric:
                value = getattr(r, name, None)
                x = None if value is None else _numeric_value(name, value, self.log_length_scale)
                if x is not None:
                    out[i, col], out[i, col + 1] = 1.0, x
                col += 2
            for name in CATEGORICAL_FIELDS:
                values = self.vocab.get(name)
                if not values:
                    continue
                v = getattr(r, name, None)
                if v in values:
                    out[i, col + values.index(v)] = 1.0
                col += len(values)
        return out

    def to_json(self) -> dict:
        return {"vocab": self.vocab, "numeric": list(self.numeric), "log_length_scale": self.log_length_scale}

    @classmethod
    def from_json(cls, data: dict) -> "MetadataEncoder":
        numeric = tuple(data.get("numeric", LEGACY_NUMERIC_FIELDS))
        unknown = [n for n in numeric if n not in NUMERIC_FIELDS]
        if unknown:
            raise PredictorError(f"predictor metadata uses unknown numeric fields {unknown}; upgrade odma")
        scale = float(data.get("log_length_scale", LEGACY_LOG_LENGTH_SCALE))
        return cls({k: list(v) for k, v in data.get("vocab", {}).items()}, numeric, scale)


def drop_metadata(meta: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Training augmentation: blank all optional metadata of a random share of rows (prompt length stays)."""
    out = meta.copy()
    rows = rng.random(len(out)) < rate
    out[rows, 1:] = 0.0
    return out
