"""odma-serve tags requests ahead of its engine loop: the length predictor runs on the tagging worker as requests
arrive and each request enters the engine with its prediction made upstream (the engine step never calls the
predictor); a predictor that hangs delays a request by the tag timeout at most; a client that leaves while its
request waits for its tag cancels it; the predictor metrics and the online learning stay right."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from odma.server.testing import MODEL, tiny_model_folder, tiny_server

WORKER, LOOP = "odma-tagger", "odma-engine"


class Recording:
    """Predicts 9 tokens; records the threads it is called on and the lengths it is told; `gate` holds predict."""

    name = "recording"
    learns = True

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.calls: list[int] = []
        self.threads: set[str] = set()
        self.told: list[int] = []

    def predict(self, requests):
        self.threads.add(threading.current_thread().name)
        self.calls.append(len(requests))
        self.gate.wait(30)
        return [(9.0, 0.1) for _ in requests]

    def observe(self, request, realized_length):
        self.threads.add(threading.current_thread().name)
        self.told.append(realized_length)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny"))


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def _wait_for(cond, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_served_requests_enter_the_engine_with_predictions_made_upstream(folder):
    predictor = Recording()
    with tiny_server(folder, predictor=predictor, tagging="ahead") as srv:
        engine = srv.runtime.engine
        assert engine.tagger.ahead is not None
        seen: list[tuple[str, tuple | None, bool, str]] = []
        tag = engine.tagger.tag

        def recording_tag(seqs, asked=None):
            for seq, done in zip(seqs, asked or [False] * len(seqs)):
                seen.append((seq.request_id, seq.tags.prediction if seq.tags else None, done,
                             threading.current_thread().name))
            return tag(seqs, asked)

        engine.tagger.tag = recording_tag
        body = {"model": MODEL, "prompt": "tell me", "max_tokens": 5, "ignore_eos": True}
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda i: httpx.post(srv.url + "/v1/completions", json=body | {"seed": i},
                                                         timeout=60), range(6)))
        assert [r.status_code for r in answers] == [200] * 6
        assert len(seen) == 6 and all(p == (9.0, 0.1) and done and t == LOOP for _, p, done, t in seen)
        assert sum(predictor.calls) == 6 and LOOP not in predictor.threads
        _wait_for(lambda: len(predictor.told) == 6)  # learned on the worker
        assert predictor.threads == {WORKER} and predictor.told == [5] * 6
        text = httpx.get(srv.url + "/metrics").text
        assert _metric(text, "odma_predictor_latency_seconds_count") == len(predictor.calls)
        assert engine.tagger.predicted == 6


def test_a_hung_predictor_delays_a_request_by_the_tag_timeout_at_most(folder):
    predictor = Recording()
    predictor.gate.clear()
    with tiny_server(folder, predictor=predictor, tagging="ahead", tag_timeout_s=0.3) as srv:
        try:
            started = time.monotonic()
            r = httpx.post(srv.url + "/v1/completions", timeout=30,
                           json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert time.monotonic() - started < 10 and srv.runtime.engine.tagger.ahead.timeouts == 1
        finally:
            predictor.gate.set()


def test_a_client_that_leaves_while_its_request_waits_for_its_tag_cancels_it(folder):
    predictor = Recording()
    predictor.gate.clear()
    with tiny_server(folder, predictor=predictor, tagging="ahead", tag_timeout_s=60) as srv:
        engine, runtime = srv.runtime.engine, srv.runtime
        try:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}
            with pytest.raises(httpx.ReadTimeout):
                with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=1.0) as r:
                    for _ in r.iter_lines():
                        pass
            _wait_for(lambda: engine.metrics.finished.get("abort", 0) == 1)
            _wait_for(lambda: not engine.has_work() and runtime.waiting == 0)
            assert engine.tagger.ahead.waiting == 0
        finally:
            predictor.gate.set()
        r = httpx.post(srv.url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "again", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200  # the server goes on



def test_auto_tags_in_the_loop_on_a_cpu_and_ahead_on_an_accelerator(folder):
    """`tagging="auto"`: a CPU server keeps the predictor in the engine step (its steps run on the cores the predictor
    would take); a backend whose steps run off the host (CUDA, MLU) tags ahead; asked for, either holds anywhere."""
    from odma.engine.config import EngineConfig

    assert EngineConfig(device="cpu").served_tagging == "loop"
    assert EngineConfig(device="cuda").served_tagging == "ahead" == EngineConfig(device="mlu").served_tagging
    assert EngineConfig(device="cuda", tagging="loop").served_tagging == "loop"
    assert EngineConfig(device="cpu", tagging="ahead").served_tagging == "ahead"
    with tiny_server(folder, predictor=Recording()) as srv:
        assert srv.runtime.engine.tagger.ahead is None
