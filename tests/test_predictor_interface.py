"""load_predictor specs, the experiment-only oracles, the scikit-learn baseline, clear errors."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from odma.config import ReservationTable
from odma.errors import PredictorError
from odma.traces import load_trace
from predictor import Prediction, load_predictor
from predictor.base import Calibration, Manifest
from predictor.oracle import NoisyOraclePredictor, OraclePredictor
from predictor.sklearn_baseline import SklearnPredictor

FIXTURE = Path(__file__).resolve().parent.parent / "datasets" / "fixtures" / "predictor_tiny.jsonl"


def test_oracle_and_noisy_oracle():
    reqs = [SimpleNamespace(request_id=f"r{i}", prompt="x", output_tokens=n) for i, n in enumerate([5, 50, 500])]
    expected = [Prediction(5.0, 0.0), Prediction(50.0, 0.0), Prediction(500.0, 0.0)]
    assert load_predictor("oracle").predict(reqs) == expected
    noisy = load_predictor("noisy-oracle:0.5")
    first, again = noisy.predict(reqs), noisy.predict(reqs)
    assert first == again  # deterministic per request id
    assert all(0 <= p.uncertainty <= 1 for p in first)
    assert NoisyOraclePredictor(0.0).predict(reqs)[1] == Prediction(50.0, 0.0)
    with pytest.raises(PredictorError):
        OraclePredictor().predict([SimpleNamespace(prompt="x", output_tokens=None)])


def test_prompt_oracle_predicts_each_answer_by_the_other_answers_to_its_prompt():
    lengths = {"a": [10, 20, 60], "b": [100, 300], "c": [7]}
    reqs = [SimpleNamespace(request_id=f"{p}{i}", prompt=p, output_tokens=n)
            for p, ns in lengths.items() for i, n in enumerate(ns)]
    got = [p.length for p in load_predictor("prompt-oracle").predict(reqs)]
    # a: (20+60)/2, (10+60)/2, (10+20)/2; b: the other one; c, answered once: the mean of every other answer
    assert got == [40.0, 35.0, 15.0, 300.0, 100.0, 490 / 5]
    assert all(p.uncertainty == 0.0 for p in load_predictor("prompt-oracle").predict(reqs))
    with_own = [p.length for p in load_predictor("prompt-oracle:with-own").predict(reqs)]
    assert with_own == [30.0, 30.0, 30.0, 200.0, 200.0, 7.0]  # every draw of the prompt, this one included
    with pytest.raises(PredictorError, match="more than one"):
        load_predictor("prompt-oracle").predict(reqs[:1])
    with pytest.raises(PredictorError, match="with-own"):
        load_predictor("prompt-oracle:median")
    with pytest.raises(PredictorError, match="realized"):
        load_predictor("prompt-oracle").predict([SimpleNamespace(prompt="x", output_tokens=None)] * 2)


@pytest.mark.parametrize("spec", ["noisy-oracle:abc", "/no/such/folder", "not-a-predictor"])
def test_bad_specs_raise_predictor_error(spec):
    with pytest.raises(PredictorError):
        load_predictor(spec)


def test_corrupt_manifest(tmp_path):
    (tmp_path / "predictor.json").write_text("{not json")
    with pytest.raises(PredictorError, match="corrupt"):
        load_predictor(str(tmp_path))
    (tmp_path / "predictor.json").write_text(json.dumps({"format_version": 1, "kind": "mystery"}))
    with pytest.raises(PredictorError, match="unknown predictor kind"):
        load_predictor(str(tmp_path))


def test_sklearn_round_trip(tmp_path):
    trace = load_trace(str(FIXTURE))
    y = np.array(trace.output_lengths())
    model = SklearnPredictor.fit(trace.records, y, (16, 64, 256, 1024))
    cal = Calibration((16, 64, 256, 1024), 2048, alpha=1.5, tau=0.9, target=0.05, ceiling=256.0)
    model.save(tmp_path, Manifest("sklearn", cal, {}))
    loaded = load_predictor(str(tmp_path))
    assert loaded.calibration == cal
    preds = loaded.predict(trace.records)
    assert preds == model.predict(trace.records) and len(preds) == len(trace)
    assert all(p.length >= 1 and 0 <= p.uncertainty <= 1 for p in preds)
    # the fixture's long/short prompts are learnable even from hand-made features
    long = np.mean([p.length for p, r in zip(preds, trace.records) if r.output_tokens > 300])
    short = np.mean([p.length for p, r in zip(preds, trace.records) if r.output_tokens < 20])
    assert long > 5 * short
    (tmp_path / "model.joblib").write_bytes(b"garbage")
    with pytest.raises(PredictorError, match="corrupt"):
        load_predictor(str(tmp_path))


def test_calibration_json_keeps_the_reservation_table():
    table = ReservationTable((12.5, 80.0), (16, 64, 256))
    cal = Calibration((16, 64, 256), 1024, target=0.02, table=table)
    back = Calibration.from_json(json.loads(json.dumps(cal.to_json())))
    assert back == cal and back.table == table
    assert cal.bucket_manager().select(100.0, 0.9).bound == 256
    assert Calibration.from_json({"bounds": [16], "large_bound": 64}).table is None  # older manifests
    for bad in ({"edges": [1.0], "tokens": [16]}, {"edges": [2.0, 1.0], "tokens": [1, 2, 3]}, {"tokens": [16]},
                {"edges": [1.0], "tokens": ["x", 2]}):
        with pytest.raises(PredictorError, match="calibration"):
            Calibration.from_json({**cal.to_json(), "table": bad})
    with pytest.raises(PredictorError, match="replaces alpha"):  # a hand-edited manifest with both
        Calibration.from_json({**cal.to_json(), "alpha": 2.0})


def test_committed_default_predictors_load_offline():
    from predictor.default import load_default_encoder

    # the encoder itself, not load_default's logged fallback to sklearn: its graph is rebuilt on this machine and
    # must pass the probe check here (an int8-only check refused it on AVX2 CPUs, and serving fell back silently)
    assert load_default_encoder().manifest.kind == "encoder"
    for spec in ("sklearn", "default", "smollm2"):
        p = load_predictor(spec)
        out = p.predict([SimpleNamespace(prompt="Write a long essay about the sea.", prompt_tokens=20)])
        assert len(out) == 1 and out[0].length > 0 and 0 <= out[0].uncertainty <= 1
        assert p.calibration is not None and p.calibration.target is not None


def test_calibration_json_keeps_the_ceiling_and_reads_manifests_without_one():
    cal = Calibration((16, 64, 256), 1024, alpha=2.0, ceiling=64.0)
    assert Calibration.from_json(json.loads(json.dumps(cal.to_json()))) == cal
    assert cal.bucket_manager().select(200.0, 0.5).bound == 64  # 200·2 would take the large bucket
    old = {"bounds": [16, 64, 256], "large_bound": 1024, "alpha": 2.0, "tau": None}  # manifests with α and τ only
    assert Calibration.from_json(old).ceiling == math.inf
    assert Calibration.from_json(json.loads(json.dumps(Calibration((16,), 64).to_json()))).ceiling == math.inf
    with pytest.raises(PredictorError, match="ceiling"):
        Calibration.from_json({**old, "ceiling": 0})
