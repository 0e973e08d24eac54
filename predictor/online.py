"""Online learning from the length log: the probe head re-fitted on the served model's own finished requests.

The engine calls three things:
- `predict(features, requests)` at the end of a prefill (one state row per request, layer `capture_layers`):
  the current online head once it has `min_samples` completions, else the shipped predictor (cold start: the
  shipped probe when it belongs to this model, else the shipped text predictor, which reads the requests);
- `observe(features, request, realized_length)` when a request finishes with a realized length (the row it was
  predicted from, kept as fp16, with its metadata);
- `calibration` for the bucket manager's α, τ, ceiling or table.

Every `refit_every` completions a background thread re-fits the head on the sliding window (closed-form ridge,
predictor/probe/fit.py), re-runs the conformal calibration on out-of-fold predictions over the same window
(predictor/calibration.py), and swaps the new model in by replacing one reference: readers never block, and
requests already admitted keep the blocks they were given. The window persists under the cache dir, keyed by the
served model's identity; a state file that is corrupt, or belongs to another model or feature layout, is refused
with a warning (and moved aside) and the predictor starts cold — never a crash.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from odma.errors import ConfigError, PredictorError
from predictor.base import Calibration, Prediction, Predictor
from predictor.calibration import calibrate
from predictor.features import MetadataEncoder
from predictor.probe.fit import LengthHead, fit_length_head, fit_ridge

log = logging.getLogger(__name__)
STATE_FORMAT = 1
STATE_FILE = "state.npz"


@dataclass(frozen=True)
class OnlineConfig:
    refit_every: int = 64  # completions between refits (docs/predictor.md: the measured choice)
    min_samples: int = 256  # the shipped predictor serves until the window holds this many
    window: int = 4096  # completions kept (the oldest drop out: the window follows drift)
    target: float = 0.02  # under-prediction rate the calibration aims at
    table_groups: int = 10  # reservation-table groups calibration may choose (0: α, τ, ceiling only)
    folds: int = 5  # out-of-fold predictions for the calibration
    large_bound: int = 2048  # the large bucket (the server's max_tokens cap)
    max_buckets: int = 8
    align: int = 16
    background: bool = True  # False: refit inline in observe() (replays, tests)
    persist_every: int = 1  # save the window after every k-th refit

    def __post_init__(self) -> None:
        if self.refit_every < 1 or self.min_samples < 2 * self.folds or self.window < self.min_samples:
            raise ConfigError(f"online predictor: need refit_every >= 1, min_samples >= {2 * self.folds} and "
                              f"window >= min_samples, got {self}")
        if not 0 < self.target < 1:
            raise ConfigError(f"online predictor: target must be in (0, 1), got {self.target}")


@dataclass(frozen=True)
class OnlineModel:
    """One fitted head and its calibration: immutable, replaced whole."""

    head: LengthHead
    calibration: Calibration
    samples: int
    refit: int
    fitted_at: float
    calibration_underprediction: float  # on the out-of-fold predictions it was calibrated on
    seconds: float  # how long the refit took


class OnlineProbe:
    def __init__(self, model_identity: str, hidden_size: int, layer: int, shipped: Predictor,
                 metadata: MetadataEncoder | None = None, config: OnlineConfig = OnlineConfig(),
                 state_dir: Path | None = None) -> None:
        """shipped: what serves until the window is full enough — a probe of this model (a predictor that
        `reads_hidden_states`: then its layer and metadata are used) or any text predictor. state_dir: where the
        window persists (None: nowhere)."""
        if getattr(shipped, "reads_hidden_states", False):
            shipped.check_model(model_identity)
            if (shipped.layer, shipped.hidden_size) != (layer, hidden_size):
                raise ConfigError(f"shipped probe reads layer {shipped.layer} of width {shipped.hidden_size}, "
                                  f"not layer {layer} of width {hidden_size}")
            metadata = shipped.metadata
        self.identity = model_identity
        self.hidden_size = hidden_size
        self.layer = layer
        self.shipped = shipped
        self.metadata = metadata or MetadataEncoder()
        self.config = config
        self.state_path = Path(state_dir) / STATE_FILE if state_dir is not None else None
        self._lock = threading.Lock()  # guards the window and the counters, never held while fitting
        self._features: deque[np.ndarray] = deque(maxlen=config.window)
        self._meta: deque[np.ndarray] = deque(maxlen=config.window)
        self._lengths: deque[int] = deque(maxlen=config.window)
        self._seen = 0
        self._since_refit = 0
        self._refits = 0
        self._refit_thread: threading.Thread | None = None
        self._model: OnlineModel | None = None  # swapped whole; readers take one reference
        self.refused_state: str | None = None
        self.last_error: str | None = None
        if self.state_path is not None:
            self._load_state()

    # -- what the engine calls ------------------------------------------------------------------

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return (self.layer,)

    @property
    def source(self) -> str:
        return "online" if self._model is not None else "shipped"

    @property
    def calibration(self) -> Calibration | None:
        model = self._model
        return model.calibration if model is not None else getattr(self.shipped, "calibration", None)

    def predict(self, features: Any, requests: Sequence[Any]) -> list[Prediction]:
        """L̂, u per request from its prompt-end state (one row each, in order)."""
        model = self._model  # one read: a refit swapping mid-call cannot mix two models
        if model is None:
            return self._shipped_predict(features, requests)
        x = self._rows(features, len(requests))
        length, unc = model.head.predict(np.hstack([x, self.metadata.encode(requests)]))
        return [Prediction(float(a), float(b)) for a, b in zip(length, unc)]

    def _shipped_predict(self, features: Any, requests: Sequence[Any]) -> list[Prediction]:
        if getattr(self.shipped, "reads_hidden_states", False):
            return self.shipped.predict_features(features, requests)
        return [Prediction(float(a), float(b)) for a, b in self.shipped.predict(requests)]

    def observe(self, features: Any, request: Any, realized_length: int) -> None:
        """A finished request: the state row it was predicted from and its realized length (capped at the
        large bound: a request stopped by max_tokens counts as that long, like the bucket manager's window)."""
        x = self._rows(np.asarray(features).reshape(1, -1), 1)[0].astype(np.float16)
        meta = self.metadata.encode([request])[0]
        length = int(realized_length)
        if length < 0:
            raise PredictorError(f"realized length must be >= 0, got {realized_length}")
        with self._lock:
            self._features.append(x)
            self._meta.append(meta)
            self._lengths.append(min(length, self.config.large_bound))
            self._seen += 1
            self._since_refit += 1
            due = len(self._lengths) >= self.config.min_samples and (
                self._since_refit >= self.config.refit_every or self._model is None)
            if due and self._refit_thread is not None and self._refit_thread.is_alive():
                due = False  # one refit at a time; the next completion asks again
            if due:
                self._since_refit = 0
                if self.config.background:
                    self._refit_thread = threading.Thread(target=self._refit_safely, name="odma-online-refit",
                                                          daemon=True)
                    self._refit_thread.start()
        if due and not self.config.background:
            self._refit_safely()

    def stats(self) -> dict:
        """What /metrics shows: the source serving predictions, the window, refits and the calibration."""
        model = self._model
        cal = self.calibration
        with self._lock:
            samples, seen = len(self._lengths), self._seen
        return {
            "source": self.source, "samples": samples, "completions_seen": seen, "refits": self._refits,
            "min_samples": self.config.min_samples, "refit_every": self.config.refit_every,
            "last_refit_seconds": round(model.seconds, 4) if model else None,
            "last_refit_at": model.fitted_at if model else None,
            "calibration_underprediction": round(model.calibration_underprediction, 4) if model else None,
            "calibration": cal.to_json() if cal is not None else None,
            "state_path": str(self.state_path) if self.state_path else None,
            "refused_state": self.refused_state, "last_error": self.last_error,
        }

    def wait(self, timeout: float | None = None) -> None:
        """Block until a running refit finishes (tests, shutdown)."""
        thread = self._refit_thread
        if thread is not None:
            thread.join(timeout)

    def close(self) -> None:
        self.wait()
        if self.state_path is not None:
            self._save_state()

    # -- refit ----------------------------------------------------------------------------------

    def _snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        with self._lock:
            return (np.stack(self._features).astype(np.float32), np.stack(self._meta),
                    np.asarray(self._lengths, dtype=np.int64))

    def _refit_safely(self) -> None:
        try:
            self.refit()
        except Exception as exc:  # noqa: BLE001 - a failed refit keeps the current model serving
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.exception("online length predictor: refit failed; keeping the current model")

    def refit(self) -> OnlineModel:
        """Fit, calibrate and swap in a new model from the current window (callable directly)."""
        started = time.perf_counter()
        states, meta, lengths = self._snapshot()
        if len(lengths) < self.config.min_samples:
            raise PredictorError(f"online refit needs {self.config.min_samples} samples, has {len(lengths)}")
        model = fit_online(np.hstack([states, meta]), lengths, self.config, self._refits + 1)
        model = OnlineModel(model.head, model.calibration, model.samples, model.refit, time.time(),
                            model.calibration_underprediction, time.perf_counter() - started)
        was = self.source
        self._model = model  # the atomic swap
        self._refits += 1
        if was != "online":
            log.info("online length predictor: switched from the shipped predictor to the online probe "
                     "(%d samples)", len(lengths))
        log.info("online length predictor: refit %d on %d samples in %.2f s; calibration %s",
                 self._refits, len(lengths), model.seconds, _describe(model.calibration))
        if self.state_path is not None and self._refits % self.config.persist_every == 0:
            self._save_state()
        return model

    # -- persistence ----------------------------------------------------------------------------

    def _header(self) -> dict:
        return {"format": STATE_FORMAT, "model_identity": self.identity, "hidden_size": self.hidden_size,
                "layer": self.layer, "metadata": self.metadata.to_json(), "refits": self._refits,
                "completions_seen": self._seen}

    def _save_state(self) -> None:
        try:
            states, meta, lengths = self._snapshot() if self._lengths else (
                np.zeros((0, self.hidden_size), np.float32), np.zeros((0, self.metadata.size), np.float32),
                np.zeros(0, np.int64))
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.state_path.parent, suffix=".tmp")
            os.close(fd)
            with open(tmp, "wb") as fh:
                np.savez(fh, header=np.array(json.dumps(self._header())), states=states.astype(np.float16),
                         meta=meta.astype(np.float32), lengths=lengths.astype(np.int32))
            os.replace(tmp, self.state_path)  # atomic: a crash leaves the old file or the new one
        except OSError as exc:
            self.last_error = f"cannot save online state: {exc}"
            log.warning("online length predictor: cannot save its state to %s (%s)", self.state_path, exc)

    def _load_state(self) -> None:
        path = self.state_path
        if not path.exists():
            return
        try:
            with np.load(path, allow_pickle=False) as d:
                header = json.loads(str(d["header"]))
                states, meta, lengths = d["states"], d["meta"], d["lengths"]
            problem = self._mismatch(header, states, meta, lengths)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is corrupt state, never a crash
            problem = f"corrupt ({type(exc).__name__}: {exc})"
        if problem is not None:
            self.refused_state = problem
            aside = path.with_name(f"{path.name}.rejected-{int(time.time())}")
            try:
                os.replace(path, aside)
            except OSError:
                aside = path
            log.warning("online length predictor: refusing its saved state %s: %s; starting from the shipped "
                        "predictor (the file is kept at %s)", path, problem, aside)
            return
        for s, m, n in zip(states[-self.config.window:], meta[-self.config.window:], lengths[-self.config.window:]):
            self._features.append(s.astype(np.float16))
            self._meta.append(m.astype(np.float32))
            self._lengths.append(int(n))
        self._seen = int(header.get("completions_seen", len(lengths)))
        self._refits = int(header.get("refits", 0))
        log.info("online length predictor: resumed %d samples from %s", len(self._lengths), path)
        if len(self._lengths) >= self.config.min_samples:
            self._refit_safely()  # serve the restored window's head at once (a refit takes well under a second)

    def _mismatch(self, header: dict, states, meta, lengths) -> str | None:
        if header.get("format") != STATE_FORMAT:
            return f"unsupported format {header.get('format')!r}"
        if header.get("model_identity") != self.identity:
            return f"it belongs to model {header.get('model_identity')}, not to the served {self.identity}"
        if header.get("layer") != self.layer or header.get("hidden_size") != self.hidden_size:
            return (f"it holds layer {header.get('layer')} states of width {header.get('hidden_size')}, the "
                    f"predictor reads layer {self.layer} of width {self.hidden_size}")
        if MetadataEncoder.from_json(header.get("metadata", {})).to_json() != self.metadata.to_json():
            return "its metadata layout differs from the predictor's"
        n = len(lengths)
        if states.shape != (n, self.hidden_size) or meta.shape != (n, self.metadata.size) or lengths.ndim != 1:
            return f"inconsistent arrays {states.shape}, {meta.shape}, {lengths.shape}"
        if not (np.all(np.isfinite(states)) and np.all(np.isfinite(meta)) and np.all(lengths >= 0)):
            return "non-finite features or negative lengths"
        return None

    def _rows(self, features: Any, n: int) -> np.ndarray:
        x = np.asarray(features.numpy() if hasattr(features, "numpy") else features, dtype=np.float32)
        if x.shape != (n, self.hidden_size):
            raise PredictorError(f"online predictor features must be [{n}, {self.hidden_size}], got {list(x.shape)}")
        if not np.all(np.isfinite(x)):
            raise PredictorError("online predictor features hold non-finite values")
        return x


def fit_online(x: np.ndarray, lengths: np.ndarray, config: OnlineConfig, refit: int = 1) -> OnlineModel:
    """A head on every row, calibrated on out-of-fold predictions of heads fitted without each fold (the
    calibration sees only predictions on rows their model did not train on)."""
    from odma.kv import BucketManager
    from odma.config import BucketConfig

    cap = config.large_bound
    y = np.minimum(np.asarray(lengths, dtype=np.int64), cap)
    head = fit_length_head(x, y, cap)
    fold = np.random.default_rng(refit).permutation(len(x)) % config.folds
    oof = np.zeros(len(x))
    log_y = np.log1p(y)
    for k in range(config.folds):
        part = fit_ridge(x[fold != k], log_y[fold != k], ridges=(head.length.ridge,))
        oof[fold == k] = np.clip(part.predict(x[fold == k]), 0.0, head.max_log_length)
    pred = np.maximum(np.expm1(oof), 1.0)
    _, unc = head.predict(x)
    bounds = BucketManager(BucketConfig(max_buckets=config.max_buckets, align=config.align, window=len(y),
                                        large_bound=cap), bootstrap=[int(v) for v in y]).bounds
    point = calibrate(pred, unc, y, bounds, cap, target=config.target, table_groups=config.table_groups)
    cal = Calibration(bounds, cap, config.align, point.alpha, point.tau, config.target, point.ceiling, point.table)
    return OnlineModel(head, cal, len(y), refit, time.time(), point.underprediction_rate, 0.0)


def _describe(cal: Calibration) -> str:
    if cal.table is not None:
        return f"table {list(cal.table.tokens)}"
    ceiling = "none" if math.isinf(cal.ceiling) else f"{cal.ceiling:.0f}"
    return f"alpha={cal.alpha:.3f} tau={cal.tau:.3f} ceiling={ceiling}"


def default_state_dir(model_identity: str) -> Path:
    """Where the online window of this served model persists: <cache dir>/online_probe/<identity>/."""
    from odma.config import default_cache_dir

    return default_cache_dir() / "online_probe" / model_identity


__all__ = ["OnlineConfig", "OnlineModel", "OnlineProbe", "default_state_dir", "fit_online"]
