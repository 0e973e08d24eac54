"""The predictor protocol (predict, observe, what a predictor declares) and the one loop every server drives it
through (`predictor.serving.ServedPredictor`: predict → usable → fallback → learn), seen through each place that
serves a predictor: the engine's tagger, odma's scheduler inside vLLM (its tags, no vLLM needed) and the Ray
ingress (no Ray needed)."""

from __future__ import annotations

import ast
import asyncio
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, Histogram

from odma.engine import EngineConfig, SamplingParams
from odma.engine.length_predictor import LoadedPredictor, load_engine_predictor, load_length_probe
from odma.engine.sequence import Sequence
from odma.engine.tagging import LengthTagger
from odma.engine.testing import tiny_engine
from odma.errors import PredictorError
from odma.models.tiny import make_tiny_model
from odma.serve_ray.front import ClusterView, FrontPredictor
from odma.vllm.tagging import LengthTags
from predictor import Prediction, Predictor, load_predictor
from predictor.base import PredictRequest

from fake_predictors import Answers
from predictor.running_median import RunningMedian
from predictor.serving import ServedPredictor, usable_prediction

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent


class Constant(Predictor):
    """A predictor that does not learn: what a trained one is to the protocol."""

    name = "constant"

    def __init__(self, length: float = 50.0) -> None:
        self.length = length
        self.observed = 0

    def predict(self, requests):
        return [Prediction(self.length, 0.25) for _ in requests]


class Learner(Predictor):
    """Learns by recording what it is told; predicts the last length it was told (64 before any)."""

    name = "learner"
    learns = True

    def __init__(self) -> None:
        self.told: list[tuple[object, int]] = []

    def predict(self, requests):
        last = float(self.told[-1][1]) if self.told else 64.0
        return [Prediction(last, 0.5) for _ in requests]

    def observe(self, request, realized_length):
        self.told.append((request, realized_length))


# -- the protocol ------------------------------------------------------------------------------------------------


def test_a_predictor_that_does_not_learn_takes_observe_as_a_no_op():
    p = Constant()
    assert not p.learns and not p.reads_hidden_states
    req = PredictRequest(prompt="hi", prompt_tokens=2)
    before = p.predict([req])
    assert p.observe(req, 900) is None
    assert p.predict([req]) == before == [Prediction(50.0, 0.25)]


def test_the_shipped_predictors_declare_what_they_are():
    from predictor.oracle import OraclePredictor
    from predictor.probe import ProbePredictor
    from predictor.sklearn_baseline import SklearnPredictor

    assert RunningMedian.learns and not RunningMedian.reads_hidden_states
    assert ProbePredictor.reads_hidden_states and not ProbePredictor.learns
    for trained in (SklearnPredictor, OraclePredictor):  # calibration fixed at export: nothing learned online
        assert not trained.learns and not trained.reads_hidden_states


@pytest.mark.parametrize("spec", ["median", "running-median"])
def test_the_running_median_learns_from_what_it_observes_and_keeps_its_name(spec):
    median = load_predictor(spec)
    assert isinstance(median, RunningMedian) and median.name == "running-median"
    req = PredictRequest(prompt=None, prompt_tokens=3)
    assert median.predict([req, req]) == [(128.0, 1.0), (128.0, 1.0)]  # the prior before any length
    for n in (10, 30, 20, 500):
        median.observe(req, n)
    assert median.predict([req]) == [(25.0, 1.0)]
    loaded = load_engine_predictor(spec)
    assert (loaded.name, loaded.fallback_reason) == ("running-median", None) and loaded.predictor.learns


def test_the_running_median_forgets_past_its_window_and_refuses_a_bad_length():
    median = RunningMedian(prior=1.0, window=3)
    for n in (1000, 1000, 4, 5, 6):
        median.observe(None, n)
    assert median.predict([None]) == [(5.0, 1.0)]
    for bad in (-1, 2.5, "7", None):
        with pytest.raises(PredictorError, match="realized length"):
            median.observe(None, bad)
    assert median.predict([None]) == [(5.0, 1.0)]  # refused lengths change nothing
    with pytest.raises(PredictorError, match="window"):
        RunningMedian(window=0)


def test_no_predictor_configured_is_the_running_median_reported_as_a_fallback():
    loaded = load_engine_predictor(None)
    assert isinstance(loaded.predictor, RunningMedian) and loaded.fallback_reason == "no predictor configured"


# -- the loop ----------------------------------------------------------------------------------------------------


def test_unusable_answers_fall_back_one_by_one_and_are_counted():
    answers = [(100.0, 0.5), (math.nan, 0.1), (math.inf, 0.1), (-5.0, 0.1), (7.0, math.nan), ("x", 0.1), None,
               (None, 0.3), (9.0, 7.0), (3.0, -1.0), 12.0]
    calls = []
    served = ServedPredictor(Answers(answers), on_call=lambda seconds, n: calls.append(n))
    got = served.predict([object()] * len(answers))
    assert got == [(100.0, 0.5), None, None, None, None, None, None, None, (9.0, 1.0), (3.0, 0.0), None]
    assert served.rejected == 6  # None and (None, u) abstain: no prediction, not a wrong one
    assert calls == [len(answers)] and served.failed_calls == 0
    assert all(isinstance(p, Prediction) for p in got if p is not None)
    assert usable_prediction((5, 0.2)) == Prediction(5.0, 0.2)


@pytest.mark.parametrize("predictor", [Answers("fail"), Answers([(1.0, 0.0)]), SimpleNamespace()])
def test_a_failing_call_or_a_wrong_count_falls_back_for_the_whole_batch(predictor):
    calls = []
    served = ServedPredictor(predictor, on_call=lambda seconds, n: calls.append((seconds >= 0, n)))
    assert served.predict(["a", "b"]) == [None, None]
    assert served.failed_calls == 1 and served.rejected == 0 and calls == [(True, 2)]
    assert served.predict([]) == [] and calls == [(True, 2)]  # an empty batch calls nothing


def test_only_a_predictor_that_learns_is_told_and_its_failure_to_learn_is_not_raised():
    learner, constant = Learner(), Constant()
    ServedPredictor(learner).observe("req", 12)
    assert learner.told == [("req", 12)]
    constant.observe = lambda *a: pytest.fail("a predictor that does not learn was told")
    ServedPredictor(constant).observe("req", 12)
    refusing = ServedPredictor(RunningMedian())
    refusing.observe(None, -3)
    assert refusing.learn_failures == 1 and refusing.predictor.predict([None]) == [(128.0, 1.0)]


# -- through the engine ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def test_the_engine_tagger_drives_the_one_loop_and_its_learner_learns_each_finished_request(folder):
    engine = tiny_engine(folder)  # predictor "median": the running median
    assert isinstance(engine.tagger.served, ServedPredictor) and engine.tagger.served.learns
    first = engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.step()
    assert first.predicted_length == 128.0  # the prior
    while not first.finished:
        engine.step()
    learner = Learner()
    engine.predictor = LoadedPredictor(learner, learner.name, None)  # the loop serves the new predictor
    done = engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert done.predicted_length == 64.0
    (request, realized), = learner.told  # told once, with the request as it was predicted
    assert realized == 5 and request == done.predict_request(engine.tagger.generator)
    nxt = engine.generate([[9, 8]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    assert nxt.predicted_length == 5.0


def test_the_engine_tagger_keeps_an_upstream_prediction_and_judges_it_like_its_own(folder):
    engine = tiny_engine(folder)
    tagger = LengthTagger(LoadedPredictor(Constant(40.0), "constant", None), engine.policy, "m", engine.metrics)
    params = SamplingParams(max_tokens=4)
    from odma.engine.sequence import RequestTags

    own = Sequence("own", [1, 2], params)
    given = Sequence("given", [1, 2], params, tags=RequestTags(prediction=(12.0, 0.5)))
    bad = Sequence("bad", [1, 2], params, tags=RequestTags(prediction=(math.nan, 0.5)))
    tagger.tag([own, given, bad])
    assert (own.predicted_length, given.predicted_length, bad.predicted_length) == (40.0, 12.0, None)
    assert tagger.rejected == 1


# -- through the vLLM plugin's tags ------------------------------------------------------------------------------


def test_the_vllm_tags_drive_the_one_loop_and_teach_the_learner_what_it_read():
    learner = Learner()
    tags = LengthTags(LoadedPredictor(learner, learner.name, None), max_tokens_cap=1024, generator="m")
    assert isinstance(tags.served, ServedPredictor)
    tag, = tags.tag(["what is 2+2?"], [9], [512], [0.0])
    tags.observe(tag, 33)
    tags.observe(None, 40)  # finished before it was tagged: no request to tell, the length still counts
    assert learner.told == [(PredictRequest(prompt="what is 2+2?", prompt_tokens=9, temperature=0.0, generator="m"),
                             33), (None, 40)]
    assert tags.tag(["next"], [3], [512], [0.0])[0].predicted == 40.0
    failing = LengthTags(LoadedPredictor(Answers([(math.inf, 0.1)]), "answers", None), max_tokens_cap=1024,
                         generator="m")
    assert failing.tag(["q"], [3], [200], [0.0])[0].reserved_output == 200 and failing.served.rejected == 1


# -- through the Ray ingress -------------------------------------------------------------------------------------


def _front(predictor) -> FrontPredictor:
    view = ClusterView(EngineConfig(max_tokens_cap=512))
    latency = Histogram("latency", "predictor latency", registry=CollectorRegistry())
    return FrontPredictor(LoadedPredictor(predictor, predictor.name, None), "m", view, latency)


def _predict_all(front: FrontPredictor, n: int) -> list:
    async def run():
        return await asyncio.gather(*(front.predict(Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8),
                                                             prompt_text=f"q{i}")) for i in range(n)))

    return asyncio.run(run())


def test_the_ingress_drives_the_one_loop_in_batches_and_falls_back_per_request():
    front = _front(Answers([(20.0, 0.2), (math.nan, 0.2), (-1.0, 0.0)]))
    assert isinstance(front.served, ServedPredictor) and not front.shared_window
    assert _predict_all(front, 3) == [(20.0, 0.2), None, None]
    assert front.calls == 1 and front.requests == 3 and front.served.rejected == 2
    failing = _front(Answers("fail"))
    assert _predict_all(failing, 2) == [None, None] and failing.served.failed_calls == 1


def test_a_learner_at_the_ingress_is_stood_in_for_by_the_clusters_shared_window():
    front = _front(RunningMedian())
    assert front.shared_window
    assert _predict_all(front, 2) == [None, None]  # no length reported yet: the replica predicts
    front.view.apply({"median": 42, "replicas": {}})
    assert _predict_all(front, 1) == [(42.0, 1.0)] and front.calls == 0  # never called off the loop


# -- the probe by what it declares -------------------------------------------------------------------------------


class DeclaredProbe:
    """Not a ProbePredictor: a predictor that declares it reads hidden states and offers the probe's interface."""

    name = "declared-probe"
    reads_hidden_states = True
    layer, refine_head, refine_every, capture_layers = 1, None, 16, (1,)

    def check_model(self, identity):
        self.checked = identity


def test_the_engine_serves_as_probe_what_declares_it_reads_hidden_states(monkeypatch):
    import predictor
    import predictor.probe.identity

    config = SimpleNamespace(probe="declared", probe_online=False, max_tokens_cap=64)
    probe = DeclaredProbe()
    monkeypatch.setattr(predictor, "load_predictor", lambda spec: probe)
    monkeypatch.setattr(predictor.probe.identity, "model_identity", lambda model: "model-x")
    served, reason = load_length_probe(config, object(), "m")
    assert reason is None and served.probe is probe and probe.checked == "model-x"
    monkeypatch.setattr(predictor, "load_predictor", lambda spec: RunningMedian())
    served, reason = load_length_probe(config, object(), "m")
    assert served is None and "reads no hidden states" in reason


# -- one copy --------------------------------------------------------------------------------------------------


def test_no_server_judges_predictions_or_picks_a_predictor_by_its_class_outside_the_loop():
    """The loop is written once: nothing outside predictor/serving.py judges an answer itself, and nothing picks
    a predictor's role by its class (it asks what the predictor declares)."""
    found = []
    for package in ("odma", "predictor"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "predictor" / "serving.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    called = ast.unparse(node.func)
                    if called.endswith("usable_prediction"):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} calls usable_prediction")
                    if called == "isinstance" and any(n in ast.unparse(node.args[1]) for n in
                                                      ("RunningMedian", "ProbePredictor", "Predictor")):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not found, "\n".join(found)
