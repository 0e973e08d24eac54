"""odma-serve with its engine in a process of its own (`--engine-process`): the same answers as the engine in
process (text, tokens, logprobs, samples, stop strings), bad input refused before anything is sent, a gone client's
block freed in the engine process, /metrics from the engine process's hooks and snapshot, and an engine process
that dies or cannot start said so instead of a hang."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from odma.server.testing import MODEL, tiny_process_server, tiny_server

CONFIG = dict(max_tokens_cap=4000, kv_budget="16MiB")


@pytest.fixture(scope="module")
def servers(tiny_folder):
    with tiny_server(tiny_folder, **CONFIG) as local, tiny_process_server(tiny_folder, **CONFIG) as remote:
        yield local, remote


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json={"model": MODEL, **body}, timeout=60)


def _stream(srv, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", srv.url + path, json={"model": MODEL, **body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _settled(srv, name: str, want, timeout: float = 20.0) -> float:
    """The metric once it equals `want` (or `want(value)` holds), polled: the engine process's snapshot lags."""
    ok = want if callable(want) else (lambda v: v == want)
    deadline = time.monotonic() + timeout
    while not ok(value := _metric(srv, name)):
        assert time.monotonic() < deadline, f"{name} = {value}"
        time.sleep(0.05)
    return value


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                         "logprobs": 2}),
    ("/v1/completions", {"prompt": "Seeded", "max_tokens": 12, "temperature": 0.9, "seed": 7, "n": 2,
                         "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 16,
                              "temperature": 0, "ignore_eos": True}),
])
def test_answers_equal_the_engine_in_process(servers, path, body):
    local, remote = servers
    a, b = _post(local, path, body).json(), _post(remote, path, body).json()
    assert a["choices"] == b["choices"] and a["usage"] == b["usage"]
    assert a["usage"]["completion_tokens"] == body["max_tokens"] * body.get("n", 1)
    text = lambda chunks, i: "".join((c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content")
                                      or "") for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
    streamed = _stream(remote, path, body)
    for i in range(body.get("n", 1)):
        choice = a["choices"][i]
        assert text(streamed, i) == choice.get("text", (choice.get("message") or {}).get("content"))


def test_a_stop_string_ends_at_the_same_token(servers):
    local, remote = servers
    body = {"prompt": "Hello", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    full = _post(local, "/v1/completions", body).json()["choices"][0]["text"]
    stop = full[4:8]
    a = _post(local, "/v1/completions", {**body, "stop": [stop]}).json()
    b = _post(remote, "/v1/completions", {**body, "stop": [stop]}).json()
    assert b["choices"][0]["text"] == full[: full.find(stop)] and b["choices"][0]["finish_reason"] == "stop"
    # the engine process ended the request at the token that completed the stop string, as the engine in process does
    assert a["usage"] == b["usage"] and b["usage"]["completion_tokens"] < 30


@pytest.mark.parametrize("body,match", [
    ({"prompt": "x", "max_tokens": 10**9}, "cap"),
    ({"prompt": [1, 2, 10**7]}, "token ids"),
    ({"prompt": "word " * 5000, "max_tokens": 200}, "cannot fit|context"),
    ({"prompt": ""}, "empty"),
])
def test_bad_input_is_refused_before_it_reaches_the_engine(servers, body, match):
    _, remote = servers
    r = _post(remote, "/v1/completions", body)
    assert r.status_code == 400 and re.search(match, r.json()["error"]["message"]), r.text
    assert _settled(remote, "odma_kv_reserved_bytes", 0.0) == 0.0
    assert _post(remote, "/v1/completions", {"prompt": "still serving", "max_tokens": 3}).status_code == 200


def test_a_gone_client_frees_its_block_in_the_engine_process(servers):
    _, remote = servers
    aborted = _metric(remote, 'odma_requests_finished_total{reason="abort"}')
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", remote.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # one chunk, then hang up
    _settled(remote, 'odma_requests_finished_total{reason="abort"}', lambda v: v > aborted)
    _settled(remote, "odma_kv_reserved_bytes", 0.0)
    assert _settled(remote, "odma_running_requests", 0.0) == 0.0


def test_metrics_come_from_the_engine_process(servers):
    _, remote = servers
    before = _metric(remote, "odma_generated_tokens_total")
    steps = _metric(remote, "odma_engine_steps_total")
    assert _post(remote, "/v1/completions", {"prompt": "count me", "max_tokens": 5, "ignore_eos": True}).status_code == 200
    assert _settled(remote, "odma_generated_tokens_total", lambda v: v >= before + 5) >= before + 5
    assert _settled(remote, "odma_engine_steps_total", lambda v: v >= steps + 5)
    text = httpx.get(remote.url + "/metrics").text
    assert 'odma_predictor_info{fallback="0",name="running-median"' in text
    assert "odma_ttft_seconds_count" in text and _metric(remote, "odma_ttft_seconds_count") >= 1
    assert _metric(remote, "odma_kv_budget_bytes") == 16 * 2**20


def test_a_dead_engine_process_fails_live_requests_and_refuses_new_ones(tiny_folder):
    with tiny_process_server(tiny_folder, **CONFIG) as srv:
        events: list[str] = []
        started = threading.Event()

        def stream():
            body = {"model": MODEL, "prompt": "a long story", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60)
        os.kill(srv.runtime.pid, signal.SIGKILL)
        reader.join(60)
        assert not reader.is_alive() and events[-1] == "[DONE]"
        assert "engine process exited" in json.loads(events[-2])["error"]["message"]
        r = _post(srv, "/v1/completions", {"prompt": "anyone?", "max_tokens": 3})
        assert r.status_code == 503, r.text
        assert not srv.runtime.alive
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 503 and "engine is not running" in health.json()["error"]["message"]


def test_an_engine_that_cannot_start_says_why(tiny_folder):
    from odma.server.engine_process import EngineProcessError

    started = time.monotonic()
    with pytest.raises(EngineProcessError, match="kv"):
        with tiny_process_server(tiny_folder, kv_budget="lots"):
            pass
    assert time.monotonic() - started < 120


def test_health_says_503_once_the_engine_loop_in_process_has_stopped(tiny_folder):
    with tiny_server(tiny_folder) as srv:
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        srv.runtime.stop()
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 503 and "engine is not running" in health.json()["error"]["message"]
