"""Tagging ahead of the engine loop (odma/engine/tag_ahead.py): requests are predicted on a worker thread as they
arrive, in batches of what arrived together; a failing or slow predictor lets them go on untagged, never lost nor
held without bound; a cancelled request's tag is dropped; the predictor (predict and observe) is only called
from the worker thread; and an engine tagging ahead starts no request before its tag unless the tag timed out."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import pytest

from odma.engine import SamplingParams
from odma.engine.length_predictor import LoadedPredictor
from odma.engine.sequence import RequestTags, Status
from odma.engine.tag_ahead import TagAhead
from odma.engine.testing import tiny_engine
from odma.models.tiny import make_tiny_model
from predictor.serving import ServedPredictor

WORKER = "odma-tagger"


class Gated:
    """Predicts `length` for each request once `gate` is open; records each call's size and thread, and learns."""

    name = "gated"
    learns = True

    def __init__(self, length: float = 7.0, *, open_gate: bool = True, fail: bool = False) -> None:
        self.length, self.fail = length, fail
        self.gate = threading.Event()
        if open_gate:
            self.gate.set()
        self.calls: list[int] = []
        self.threads: set[str] = set()
        self.told: list[int] = []
        self.entered = threading.Event()

    def predict(self, requests):
        self.threads.add(threading.current_thread().name)
        self.calls.append(len(requests))
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        if self.fail:
            raise RuntimeError("predictor down")
        return [(self.length, 0.25) for _ in requests]

    def observe(self, request, realized_length):
        self.threads.add(threading.current_thread().name)
        self.told.append(realized_length)


def _wait_for(cond, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _collect(ahead: TagAhead, count: int, seconds: float = 10.0) -> list:
    out: list = []
    deadline = time.monotonic() + seconds
    while len(out) < count:
        assert time.monotonic() < deadline, f"only {len(out)} of {count} came back"
        ahead.wait(0.05)
        out += ahead.ready()
    return out


# -- the worker alone --------------------------------------------------------------------------------------------


def test_what_arrives_while_the_predictor_works_is_predicted_in_the_next_batches_in_order():
    predictor = Gated(open_gate=False)
    ahead = TagAhead(ServedPredictor(predictor), max_batch=3)
    try:
        ahead.ask("r0", "q0", "w0")
        assert predictor.entered.wait(10)  # the first request is predicted alone, at once
        for i in range(1, 6):
            ahead.ask(f"r{i}", f"q{i}", f"w{i}")
        predictor.gate.set()
        got = _collect(ahead, 6)
    finally:
        ahead.close()
    assert predictor.calls == [1, 3, 2]  # what arrived together, at most max_batch per call
    assert [w for w, _ in got] == [f"w{i}" for i in range(6)]
    assert all(p == (7.0, 0.25) for _, p in got) and ahead.batches == 3 and ahead.waiting == 0
    assert predictor.threads == {WORKER}


def test_a_failing_predictor_answers_none_and_loses_no_request():
    predictor = Gated(fail=True)
    served = ServedPredictor(predictor)
    ahead = TagAhead(served, max_batch=8)
    try:
        for i in range(4):
            ahead.ask(f"r{i}", f"q{i}", i)
        got = _collect(ahead, 4)
    finally:
        ahead.close()
    assert sorted(w for w, _ in got) == [0, 1, 2, 3] and all(p is None for _, p in got)
    assert served.failed_calls >= 1


def test_a_tag_later_than_the_timeout_is_handed_over_as_none_and_the_late_one_dropped():
    predictor = Gated(open_gate=False)
    ahead = TagAhead(ServedPredictor(predictor), timeout_s=0.1)
    try:
        ahead.ask("slow", "q", "w")
        assert predictor.entered.wait(10)
        assert ahead.ready() == []  # not yet late
        got = _collect(ahead, 1)
        assert got == [("w", None)] and ahead.timeouts == 1
        predictor.gate.set()
        _wait_for(lambda: ahead.batches == 1)
        assert ahead.ready() == [] and ahead.waiting == 0  # the late answer reaches nobody
    finally:
        ahead.close()


def test_a_dropped_request_is_neither_predicted_nor_handed_back():
    predictor = Gated(open_gate=False)
    ahead = TagAhead(ServedPredictor(predictor))
    try:
        ahead.ask("first", "q", "first")
        assert predictor.entered.wait(10)
        ahead.ask("gone", "q", "gone")
        ahead.ask("kept", "q", "kept")
        assert ahead.drop("gone") == "gone" and ahead.drop("gone") is None
        predictor.gate.set()
        got = _collect(ahead, 2)
    finally:
        ahead.close()
    assert [w for w, _ in got] == ["first", "kept"] and predictor.calls == [1, 1]


def test_lessons_are_learned_on_the_worker_before_the_next_prediction():
    predictor = Gated()
    ahead = TagAhead(ServedPredictor(predictor))
    try:
        ahead.learn("done", 11)
        ahead.ask("next", "q", "next")
        _collect(ahead, 1)
    finally:
        ahead.close()
    assert predictor.told == [11] and predictor.threads == {WORKER}


def test_a_lesson_for_a_replaced_predictor_does_not_reach_its_successor():
    old, new = Gated(), Gated()
    old.gate.clear()  # the worker is busy predicting when the lesson and the swap come
    served = ServedPredictor(old)
    ahead = TagAhead(served)
    try:
        ahead.ask("busy", "q", "busy")
        assert old.entered.wait(10)
        ahead.learn("warm-up", 4)
        served.predictor = new
        old.gate.set()
        ahead.ask("next", "q", "next")
        _collect(ahead, 2)
    finally:
        ahead.close()
    assert new.told == [] and old.told == []


def test_after_close_a_request_goes_on_untagged_at_once():
    ahead = TagAhead(ServedPredictor(Gated()))
    ahead.close()
    ahead.ask("late", "q", "late")
    assert ahead.ready() == [("late", None)]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        TagAhead(ServedPredictor(Gated()), max_batch=0)
    with pytest.raises(ValueError):
        TagAhead(ServedPredictor(Gated()), timeout_s=0)


# -- through the engine ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def _engine(folder, predictor, **overrides):
    engine = tiny_engine(folder, tagging="ahead", **overrides)
    engine.predictor = LoadedPredictor(predictor, predictor.name, None)
    return engine


PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_the_engine_starts_no_request_before_its_tag_and_learns_off_the_loop(folder):
    predictor = Gated(open_gate=False)
    engine = _engine(folder, predictor)
    try:
        seq = engine.add_request([5, 6, 7], PARAMS)
        assert predictor.entered.wait(10)
        for _ in range(5):  # the loop goes on (nothing else to do) but does not start it untagged
            assert engine.has_work()
            assert engine.step() == []
        assert seq.status is Status.WAITING and seq.num_generated == 0 and engine.num_waiting == 1
        predictor.gate.set()
        while not seq.finished:
            engine.step()
        assert seq.predicted_length == 7.0 and seq.tags.prediction == (7.0, 0.25)
        assert seq.num_generated == 4 and engine.tagger.predicted == 1 and engine.tagger.predict_seconds > 0
        _wait_for(lambda: predictor.told == [4])  # learned, on the worker
        assert predictor.threads == {WORKER}
    finally:
        engine.close()


def test_a_request_whose_tag_times_out_runs_untagged(folder):
    predictor = Gated(open_gate=False)
    engine = _engine(folder, predictor, tag_timeout_s=0.2)
    try:
        started = time.monotonic()
        seq = engine.add_request([5, 6, 7], PARAMS)
        while not seq.finished:
            engine.step()
        assert time.monotonic() - started >= 0.2
        assert seq.predicted_length is None and seq.num_generated == 4 and engine.tagger.ahead.timeouts == 1
        scraped = _scrape(engine)  # what /metrics shows of it
        assert scraped["odma_tag_timeouts_total"] == 1 and scraped["odma_tags_waiting"] == 0
        assert scraped["odma_tag_batches_total"] == engine.tagger.ahead.batches
    finally:
        predictor.gate.set()
        engine.close()


def _scrape(engine) -> dict[str, float]:
    from odma.server.metrics import Metrics

    metrics = Metrics()
    metrics.attach(SimpleNamespace(stats=engine.stats, waiting=0))
    return {s.name: s.value for family in metrics.registry.collect() for s in family.samples if not s.labels}


def test_a_failing_predictor_lets_requests_run_untagged_without_asking_again_in_the_loop(folder):
    predictor = Gated(fail=True)
    engine = _engine(folder, predictor)
    try:
        seqs = engine.generate([[1, 2, 3], [4, 5]], PARAMS)
        assert all(s.num_generated == 4 and s.predicted_length is None for s in seqs)
        assert sum(predictor.calls) == 2 and predictor.threads == {WORKER}  # never retried inside the step
        assert engine.tagger.served.failed_calls >= 1
    finally:
        engine.close()


def test_a_request_cancelled_while_it_waits_for_its_tag_ends_at_once_and_frees_its_place(folder):
    predictor = Gated(open_gate=False)
    engine = _engine(folder, predictor)
    try:
        seq = engine.add_samples([5, 6, 7], PARAMS, 2, request_id="c")
        assert predictor.entered.wait(10)
        assert engine.num_waiting == 2  # both samples wait for the first's tag
        engine.abort("c")
        engine.abort("c.1")
        outputs = engine.step()
        assert {o.seq.request_id for o in outputs if o.finished} == {"c", "c.1"}
        assert all(s.finish_reason == "abort" for s in seq) and not engine.has_work()
        predictor.gate.set()
        _wait_for(lambda: engine.tagger.ahead.batches == 1)
        assert engine.step() == [] and not engine.has_work()  # the late tag reaches nobody
        assert all(s.num_generated == 0 for s in seq)
    finally:
        engine.close()


def test_the_other_samples_of_a_request_cancelled_while_tagged_still_run(folder):
    predictor = Gated(open_gate=False)
    engine = _engine(folder, predictor)
    try:
        first, second = engine.add_samples([5, 6, 7], PARAMS, 2, request_id="s")
        assert predictor.entered.wait(10)
        engine.abort("s")
        engine.step()
        predictor.gate.set()
        while engine.has_work():
            engine.step()
        assert first.finish_reason == "abort" and second.num_generated == 4 and second.finish_reason == "length"
    finally:
        engine.close()


def test_an_upstream_prediction_skips_the_worker(folder):
    predictor = Gated(open_gate=False)  # would hang a request that waited for it
    engine = _engine(folder, predictor)
    try:
        seq = engine.add_request([1, 2], PARAMS, tags=RequestTags(prediction=(3.0, 0.0)))
        while not seq.finished:
            engine.step()
        assert seq.predicted_length == 3.0 and predictor.calls == []
    finally:
        predictor.gate.set()
        engine.close()


def test_no_request_is_lost_when_many_threads_add_and_cancel_while_the_loop_steps(folder):
    predictor = Gated(length=5.0)
    engine = _engine(folder, predictor, tag_batch=4)
    added: list = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(k: int) -> None:
        rng = random.Random(k)
        for i in range(12):
            seq = engine.add_request([1 + k, 2 + i], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                                     request_id=f"t{k}-{i}")
            with lock:
                added.append(seq)
            if rng.random() < 0.3:
                engine.abort(seq.request_id)
            time.sleep(rng.random() * 0.003)

    def loop() -> None:
        while not stop.is_set() or engine.has_work():
            engine.step() if engine.has_work() else time.sleep(0.001)

    stepper = threading.Thread(target=loop)
    stepper.start()
    clients = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    try:
        for c in clients:
            c.start()
        for c in clients:
            c.join(60)
        stop.set()
        stepper.join(60)
        assert not stepper.is_alive()
        assert len(added) == 48 and all(s.finished for s in added)
        ran = [s for s in added if s.finish_reason == "length"]
        assert ran and all(s.num_generated == 3 and s.predicted_length == 5.0 for s in ran)
        assert all(s.finish_reason in ("length", "abort") for s in added)
        assert engine.tagger.ahead.waiting == 0 and engine.num_waiting == 0 and engine.tagger.ahead.timeouts == 0
        assert predictor.threads == {WORKER}
    finally:
        stop.set()
        engine.close()
