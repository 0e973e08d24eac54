"""Which length predictor a server runs: the one its config names, with a fallback.

The predictors live in the `predictor` package (and `predictor.serving` drives one while serving). When the one
asked for cannot be loaded (not built yet, missing files), the server still runs with `RunningMedian`: L̂ = median
of recently realized lengths, u = 1.0. The fallback and its reason are logged at start-up and exported in /metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from predictor.running_median import RunningMedian

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedPredictor:
    predictor: Any
    name: str
    fallback_reason: str | None  # None: the requested predictor loaded


def load_engine_predictor(spec: str | None) -> LoadedPredictor:
    """`spec` as `predictor.load_predictor` takes it ("default", "sklearn", "median", "oracle", a folder); none
    configured is the running median, reported as a fallback."""
    if not spec:
        return LoadedPredictor(RunningMedian(), RunningMedian.name, "no predictor configured")
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
        from predictor.probe.identity import model_identity

        probe = load_predictor(config.probe)
        if not getattr(probe, "reads_hidden_states", False):
            raise ValueError(f"{config.probe!r} is a {type(probe).__name__}, which reads no hidden states: "
                             "not a probe (kind 'probe')")
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
