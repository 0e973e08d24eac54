"""No input reaches the engine loop in a form that can fail a step: a prediction that is NaN, infinite or
negative (a temperature of 1e39 overflowed float32 in the predictor's input and L̂ became NaN) leaves the
request untagged, reserving for the worst case, and every other request in flight goes on."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from odma.engine import SamplingParams
from odma.engine.length_predictor import LoadedPredictor
from odma.engine.testing import tiny_engine
from odma.models.tiny import make_tiny_model
from predictor.features import NUMERIC_FIELDS, MetadataEncoder

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


class ChokesOnSomeRequests:
    """Answers `bad` for 3-token prompts, as the encoder answered NaN for a temperature past float32's range."""

    name = "chokes"

    def __init__(self, bad=math.nan):
        self.bad = bad

    def predict(self, requests):
        return [(self.bad, 0.2) if r.prompt_tokens == 3 else (12.0, 0.2) for r in requests]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -5.0, None, "x"])
def test_an_unusable_prediction_cannot_fail_the_step_of_others(folder, bad):
    engine = tiny_engine(folder)
    engine.predictor = LoadedPredictor(ChokesOnSomeRequests(bad), "t", None)
    normal = [engine.add_request([5, 6, 7, i], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
              for i in range(3)]
    for _ in range(3):
        engine.step()  # the normal requests are decoding...
    odd = engine.add_request([9, 9, 9], SamplingParams(max_tokens=8, temperature=1.0, seed=1, ignore_eos=True))
    while not all(s.finished for s in [*normal, odd]):
        engine.step()  # ...when the pathological one arrives: before the fix this step raised
    assert [s.finish_reason for s in normal] == ["length"] * 3 and odd.finish_reason == "length"
    assert odd.predicted_length is None and odd.bucket is None  # untagged: reserved for the worst case
    assert all(s.predicted_length == 12.0 for s in normal)
    assert engine.rejected_predictions == (0 if bad is None else 1)
    assert engine.pool.stats().live_blocks == 0
    engine.pool.check_invariants()


def test_a_predictor_returning_too_few_answers_does_not_fail_the_step(folder):
    engine = tiny_engine(folder)
    engine.predictor = LoadedPredictor(SimpleNamespace(predict=lambda reqs: []), "short", None)
    seq = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert seq.finish_reason == "length" and seq.predicted_length is None


@pytest.mark.parametrize("temperature", [1e39, 3.5e38, 1e300, math.inf, -math.inf, math.nan, -1.0])
def test_metadata_features_stay_finite_whatever_the_request_says(temperature):
    enc = MetadataEncoder({}, NUMERIC_FIELDS, 1.0)
    req = SimpleNamespace(prompt="hi", prompt_tokens=10**40, temperature=temperature, depth=10**400,
                          prior_output_tokens=math.inf, last_output_tokens=1e308)
    row = enc.encode([req])[0]
    assert np.isfinite(row).all()
    temp_flag, temp_value = row[1], row[2]
    if math.isnan(temperature):
        assert (temp_flag, temp_value) == (0.0, 0.0)  # unusable: counted as absent
    else:
        assert temp_flag == 1.0 and 0.0 <= temp_value <= 2.0


def test_the_decode_kernel_leaves_the_process_float_mode_alone():
    """Linked with -ffast-math, the kernel turned on flush-to-zero for the whole server: a request's top_p of
    5e-324 (valid JSON, > 0) was parsed as 0.0 and refused."""
    import backends.cpu_attention as cpu_attention

    if cpu_attention.load() is None:
        pytest.skip("no C compiler: the kernel is not loaded")
    assert float("5e-324") > 0.0 and 2.2250738585072014e-308 / 2 > 0.0
    assert torch.tensor([1e-40]).item() > 0.0  # float32 denormals survive too
