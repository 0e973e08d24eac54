"""The length predictor as the engine sees it: `predict(requests) -> [(L̂, u)]`, with a fallback.

The trained predictor lives in the `predictor` package. When it cannot be loaded (not built yet, missing
files), the engine still runs with `RunningMedian`: L̂ = median of recently realized lengths, u = 1.0.
The fallback and its reason are logged at start-up and exported in /metrics.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

log = logging.getLogger(__name__)


class RunningMedian:
    """Trivial predictor: the median realized length of the last `window` requests (`prior` before any)."""

    name = "running-median"

    def __init__(self, prior: float = 128.0, window: int = 512) -> None:
        self._lengths: deque[int] = deque(maxlen=window)
        self._prior = prior
        self._lock = threading.Lock()

    def predict(self, requests: Sequence[Any]) -> list[tuple[float, float]]:
        with self._lock:
            guess = float(statistics.median(self._lengths)) if self._lengths else self._prior
        return [(guess, 1.0) for _ in requests]

    def observe(self, realized: int) -> None:
        with self._lock:
            self._lengths.append(realized)


def usable_prediction(pred: Any) -> tuple[float, float] | None:
    """(L̂, u) when a predictor's answer can size a reservation: L̂ finite and >= 0, u finite (clamped to
    [0, 1]); None otherwise (NaN from an overflowing input, a failed call), and the request reserves for
    the worst case."""
    try:
        length, u = float(pred[0]), float(pred[1])
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if not (math.isfinite(length) and length >= 0 and math.isfinite(u)):
        return None
    return length, min(max(u, 0.0), 1.0)


@dataclass(frozen=True, slots=True)
class LoadedPredictor:
    predictor: Any
    name: str
    fallback_reason: str | None  # None: the requested predictor loaded


def load_engine_predictor(spec: str | None) -> LoadedPredictor:
    """`spec` as `predictor.load_predictor` takes it ("default", "sklearn", "oracle", a folder), or
    "median" for the fallback itself."""
    if spec in (None, "", "median", "running-median"):
        return LoadedPredictor(RunningMedian(), RunningMedian.name, None if spec else "no predictor configured")
    try:
        from predictor import load_predictor

        p = load_predictor(spec)
        # a predictor may itself stand in for the one asked for (the default encoder's sklearn fallback)
        return LoadedPredictor(p, getattr(p, "name", spec), getattr(p, "fallback_reason", None))
    except Exception as exc:  # noqa: BLE001 - any failure to load degrades to the fallback, loudly
        reason = f"{type(exc).__name__}: {exc}"
        log.warning("length predictor %r unavailable (%s); using the running-median fallback (u = 1.0)", spec, reason)
        return LoadedPredictor(RunningMedian(), RunningMedian.name, reason)


def load_length_probe(config, model, generator: str) -> tuple[Any, str | None]:
    """(LengthProbe, None), or (None, why not) when `config.probe` is unset or cannot serve this model: a probe
    that fails to load, or was trained on another model's hidden states, is refused with a warning, never a crash."""
    if not config.probe:
        return None, None
    try:
        from odma.engine.length_probe import LengthProbe
        from predictor import load_predictor
        from predictor.probe import ProbePredictor
        from predictor.probe.identity import model_identity

        probe = load_predictor(config.probe)
        if not isinstance(probe, ProbePredictor):
            raise ValueError(f"{config.probe!r} is a {type(probe).__name__}, not a probe (kind 'probe')")
        identity = model_identity(model)
        probe.check_model(identity)
        online = None
        if config.probe_online:
            from predictor.online import OnlineConfig, OnlineProbe, default_state_dir

            online = OnlineProbe(identity, probe.hidden_size, probe.layer, probe,
                                 config=OnlineConfig(large_bound=config.max_tokens_cap),
                                 state_dir=default_state_dir(identity))
        log.info("length probe: layer %d%s, %s", probe.layer,
                 f", refined every {probe.refine_every} tokens" if probe.refine_head is not None else "",
                 f"online ({online.source}, state {online.state_path})" if online is not None else "shipped heads only")
        return LengthProbe(probe, online, generator), None
    except Exception as exc:  # noqa: BLE001 - a probe that cannot serve leaves serving on the text predictor
        reason = f"{type(exc).__name__}: {exc}"
        log.warning("length probe %r unavailable (%s); serving without it", config.probe, reason)
        return None, reason
