"""The online probe: cold start on the shipped predictor, refits from completions, calibration that holds on
fresh draws, persistence, refusal of corrupt or another model's state, and atomic swaps under concurrent reads."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

import predictor.online as online
from odma.errors import ConfigError, PredictorError
from predictor.base import Calibration, Prediction, Predictor
from predictor.online import OnlineConfig, OnlineProbe

HIDDEN = 8


class ConstantShipped(Predictor):
    name = "constant"
    calibration = Calibration((64, 128, 256, 512), 2048, 16, 0.5, target=0.1)

    def predict(self, requests):
        return [Prediction(100.0, 0.5) for _ in requests]


def draw(n: int, seed: int) -> tuple[np.ndarray, list, np.ndarray]:
    """Features whose first column drives log length (plus noise), as a probe's hidden state would."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, HIDDEN)).astype(np.float32)
    lengths = np.minimum(np.expm1(4.0 + 0.9 * x[:, 0] + rng.normal(scale=0.3, size=n)), 2048).astype(int) + 1
    return x, [SimpleNamespace(prompt=None, prompt_tokens=30, temperature=0.7) for _ in range(n)], lengths


def make(tmp_path, identity="model-a", layer=3, **cfg) -> OnlineProbe:
    config = OnlineConfig(**{"min_samples": 200, "refit_every": 50, "background": False, "target": 0.1, **cfg})
    return OnlineProbe(identity, HIDDEN, layer, ConstantShipped(), config=config, state_dir=tmp_path)


def feed(probe: OnlineProbe, x, requests, lengths) -> None:
    for row, r, n in zip(x, requests, lengths):
        probe.observe(row, r, int(n))


def test_cold_start_then_switch_to_the_online_head(tmp_path):
    from scipy.stats import spearmanr

    probe = make(tmp_path)
    x, reqs, y = draw(600, 0)
    feed(probe, x[:199], reqs[:199], y[:199])
    assert probe.source == "shipped" and probe.stats()["refits"] == 0
    assert probe.predict(x[:3], reqs[:3]) == [Prediction(100.0, 0.5)] * 3
    assert probe.calibration == ConstantShipped.calibration
    feed(probe, x[199:], reqs[199:], y[199:])
    stats = probe.stats()
    assert stats["source"] == "online" and stats["samples"] == 600 and stats["refits"] == 9  # at 200, 250, ..., 600
    assert stats["calibration"]["target"] == 0.1
    fresh, freqs, fy = draw(500, 1)
    pred = np.array([p.length for p in probe.predict(fresh, freqs)])
    assert spearmanr(pred, fy)[0] > 0.85


def test_calibration_meets_its_target_on_fresh_draws(tmp_path):
    probe = make(tmp_path, min_samples=400, window=2000)
    x, reqs, y = draw(2000, 2)
    feed(probe, x, reqs, y)
    manager = probe.calibration.bucket_manager()
    fresh, freqs, fy = draw(5000, 3)
    reserved = np.array([manager.select(p.length, p.uncertainty).bound for p in probe.predict(fresh, freqs)])
    assert abs(np.mean(fy > reserved) - 0.1) < 0.03
    assert reserved.sum() < len(fy) * np.quantile(fy, 0.9)  # cheaper than one constant at the same miss rate


def test_state_persists_and_resumes(tmp_path):
    probe = make(tmp_path)
    x, reqs, y = draw(300, 4)
    feed(probe, x, reqs, y)
    probe.close()
    again = make(tmp_path)
    assert again.source == "online" and again.stats()["samples"] == 300 and again.refused_state is None
    assert again.stats()["completions_seen"] == 300


def test_corrupt_state_is_refused_with_a_warning_and_moved_aside(tmp_path, caplog):
    (tmp_path / "state.npz").write_bytes(b"\x00garbage")
    with caplog.at_level(logging.WARNING, logger="predictor.online"):
        probe = make(tmp_path)
    assert probe.source == "shipped" and "corrupt" in probe.refused_state
    assert "refusing its saved state" in caplog.text
    assert not (tmp_path / "state.npz").exists() and list(tmp_path.glob("state.npz.rejected-*"))
    x, reqs, y = draw(250, 5)
    feed(probe, x, reqs, y)  # and it learns afresh
    assert probe.source == "online"


def test_another_models_or_layers_state_is_refused(tmp_path):
    probe = make(tmp_path, identity="model-a")
    x, reqs, y = draw(250, 6)
    feed(probe, x, reqs, y)
    probe.close()
    other = make(tmp_path, identity="model-b")
    assert other.source == "shipped" and "belongs to model model-a" in other.refused_state
    probe = make(tmp_path / "b", identity="model-a", layer=3)
    feed(probe, x, reqs, y)
    probe.close()
    wrong_layer = make(tmp_path / "b", identity="model-a", layer=4)
    assert wrong_layer.source == "shipped" and "layer 3" in wrong_layer.refused_state


def test_a_failed_refit_keeps_the_current_model(tmp_path, monkeypatch):
    probe = make(tmp_path)
    x, reqs, y = draw(250, 7)
    feed(probe, x[:200], reqs[:200], y[:200])
    before = probe._model
    monkeypatch.setattr(online, "fit_online", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    feed(probe, x[200:], reqs[200:], y[200:])
    assert probe._model is before and "boom" in probe.stats()["last_error"]


def test_bad_input_is_refused_without_changing_the_window(tmp_path):
    probe = make(tmp_path)
    x, reqs, y = draw(3, 8)
    with pytest.raises(PredictorError, match="features must be"):
        probe.observe(np.zeros(HIDDEN + 1), reqs[0], 10)
    with pytest.raises(PredictorError, match="non-finite"):
        probe.observe(np.full(HIDDEN, np.nan), reqs[0], 10)
    with pytest.raises(PredictorError, match="realized length"):
        probe.observe(x[0], reqs[0], -1)
    assert probe.stats()["samples"] == 0
    with pytest.raises(ConfigError):
        OnlineConfig(min_samples=4)


def test_swaps_are_atomic_under_concurrent_predict(tmp_path, monkeypatch):
    """Readers predicting while background refits swap models always see one whole model: every batch they get
    equals the shipped predictor's or one installed model's prediction for that batch."""
    installed = []
    real_fit = online.fit_online

    def recording_fit(*args, **kwargs):
        model = real_fit(*args, **kwargs)
        installed.append(model)
        return model

    monkeypatch.setattr(online, "fit_online", recording_fit)
    probe = make(tmp_path, min_samples=100, refit_every=20, background=True)
    x, reqs, y = draw(500, 9)
    batch, breqs = x[:16], reqs[:16]
    seen: list[list[Prediction]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader():
        try:
            while not stop.is_set():
                seen.append(probe.predict(batch, breqs))
                time.sleep(0.0005)  # let the refit thread run: three spinning readers starve it of the GIL
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for start in range(16, len(x), 100):  # completions arrive while refits run and readers read
        feed(probe, x[start : start + 100], reqs[start : start + 100], y[start : start + 100])
        probe.wait()
    stop.set()
    for t in threads:
        t.join()
    assert not errors and len(installed) >= 3 and probe.source == "online"
    meta = probe.metadata.encode(breqs)
    expected = [ConstantShipped().predict(breqs)]
    for model in installed:
        length, unc = model.head.predict(np.hstack([batch, meta]))
        expected.append([Prediction(float(a), float(b)) for a, b in zip(length, unc)])
    assert all(any(got == want for want in expected) for got in seen)
    assert any(got != expected[0] for got in seen)  # the readers did see online models
