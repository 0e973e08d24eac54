"""One request never stalls the others: text too long for any context is refused by its length before it is
tokenized (a 10 MB prompt once held the event loop for most of a minute), a body too large for any prompt is
refused unread, and a request's own CPU work (template, tokenization, rendering) runs off the event loop.
Timing is asserted only with wide margins; the rest is structural (which thread, whether the tokenizer ran)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from odma.server import jobs, streams
from odma.server.testing import MODEL, tiny_server

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def srv(tiny_folder):
    with tiny_server(tiny_folder, max_tokens_cap=4000) as s:
        yield s


@pytest.fixture
def encoded(monkeypatch):
    """The (text length, thread name) of every prompt the server tokenizes."""
    seen: list[tuple[int, str]] = []
    encode = jobs.JobBuilder._encode

    def spy(self, text):
        seen.append((len(text), threading.current_thread().name))
        return encode(self, text)

    monkeypatch.setattr(jobs.JobBuilder, "_encode", spy)
    return seen


def _bound(srv) -> int:
    engine = srv.runtime.engine
    return jobs.max_prompt_chars(engine.tokenizer, engine.max_model_len)


def test_the_bound_is_the_context_times_the_longest_token(srv):
    tok = srv.runtime.engine.tokenizer
    longest = max(len(tok.decode([i])) for i in range(len(tok)))
    assert _bound(srv) >= srv.runtime.engine.max_model_len * longest  # never refuses a prompt that could fit


def test_text_that_cannot_fit_is_refused_before_it_is_tokenized(srv, encoded):
    too_long = "a" * (_bound(srv) + 1)
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": too_long, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "request_too_large"
    assert "characters" in r.json()["error"]["message"]
    halves = [{"role": "user", "content": too_long[: len(too_long) // 2]},
              {"role": "assistant", "content": "ok"}, {"role": "user", "content": too_long[len(too_long) // 2:]}]
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": halves}, timeout=60)
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    assert encoded == []  # the tokenizer never saw them


def test_a_body_too_large_for_any_prompt_is_refused_in_the_api_shape(srv, encoded):
    limit = 12 * _bound(srv) + (1 << 20)
    body = json.dumps({"model": MODEL, "prompt": "a " * (limit // 2), "max_tokens": 1}).encode()
    for content in (body, iter([body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)])):  # sized, chunked
        r = httpx.post(srv.url + "/v1/completions", content=content, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 413, r.text
        assert f"{limit:,} bytes" in r.json()["error"]["message"]
    assert encoded == []


def test_a_request_is_tokenized_and_rendered_off_the_event_loop(srv, encoded, monkeypatch):
    rendered: list[str] = []
    choice_body = streams.choice_body

    def spy(sample):
        rendered.append(threading.current_thread().name)
        return choice_body(sample)

    monkeypatch.setattr(streams, "choice_body", spy)
    for path, body in (("/v1/completions", {"prompt": "Hello there", "echo": True, "logprobs": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]})):
        r = httpx.post(srv.url + path, json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)
        assert r.status_code == 200, r.text
    assert [name for _, name in encoded] == ["odma-request-work_0"] * 2
    assert rendered == ["odma-request-work_0"] * 2


def test_a_slow_request_stalls_neither_health_nor_a_neighbour_stream(srv, monkeypatch):
    """A tokenization held for 4 s (a stand-in for a huge prompt's) while a long stream runs: the stream keeps
    sending and /health answers (margins of seconds: on the event loop both waited the whole 4 s)."""
    encode = jobs.JobBuilder._encode

    def slow(self, text):
        if text.startswith("slow"):
            time.sleep(4.0)
        return encode(self, text)

    monkeypatch.setattr(jobs.JobBuilder, "_encode", slow)
    chunks: list[float] = []
    started, done = threading.Event(), threading.Event()

    def neighbour():
        body = {"model": MODEL, "prompt": "a story", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                chunks.append(time.monotonic())
                started.set()
                if done.is_set():
                    return  # leaving cancels the rest

    streaming = threading.Thread(target=neighbour)
    streaming.start()
    assert started.wait(30)
    slow_one = threading.Thread(target=lambda: httpx.post(
        srv.url + "/v1/completions", json={"model": MODEL, "prompt": "slow one", "max_tokens": 1}, timeout=60))
    t0 = time.monotonic()
    slow_one.start()
    time.sleep(0.5)  # the slow request is in its tokenization now
    health = []
    while time.monotonic() - t0 < 3.5:
        start = time.monotonic()
        assert httpx.get(srv.url + "/health", timeout=60).status_code == 200
        health.append(time.monotonic() - start)
        time.sleep(0.1)
    done.set()
    slow_one.join()
    streaming.join()
    assert max(health) < 2.0
    window = [t for t in chunks if t0 <= t <= t0 + 3.5]
    assert chunks[-1] >= t0 + 3.5  # the stream ran through the whole stall
    assert len(window) >= 3 and max(b - a for a, b in zip(window, window[1:])) < 2.0  # and kept sending


def test_the_fast_encoding_path_gives_the_tokenizers_ids(srv):
    tok = srv.runtime.engine.tokenizer
    builder = jobs.JobBuilder(srv.runtime.engine, None, None)
    for text in ("Hello, world!", "<|im_start|>user\nhi<|im_end|>\n", "Tokyo 東京 🙂", "  spaces\n\n\ttabs  "):
        assert builder._encode(text) == tok.encode(text, add_special_tokens=False)
