"""The OpenAI-compatible server over a tiny random model (SmolLM2's tokenizer, random weights): the official
`openai` client works unmodified, bad input gets a clear 4xx, busy gets 429, a gone client frees its block."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch

from odma.config import PoolConfig
from odma.engine import EngineConfig, LLMEngine
from odma.models import load_model
from odma.models.tiny import make_tiny_model
from odma.server.app import create_app
from odma.server.metrics import Metrics
from odma.server.runtime import AsyncEngine
from odma.server.testing import leave_early
from odma.server.threaded import ThreadedServer

torch.set_num_threads(1)
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from odma.tokenizer import load_tokenizer

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", vocab_size=49152, eos_token_id=2)
    config = EngineConfig(model=str(folder), kv_budget="4MiB", length_log=tmp_path_factory.mktemp("log") / "l.jsonl",
                          predictor="median", max_tokens_cap=256, default_max_tokens=16, threads=1,
                          pool=PoolConfig(align=16))
    metrics = Metrics()
    engine = LLMEngine(config, model=load_model(folder), tokenizer=load_tokenizer("smollm2").hf, metrics=metrics)
    runtime = AsyncEngine(engine, max_queue=64)
    metrics.attach(runtime)
    with ThreadedServer(create_app(runtime, metrics, MODEL)) as srv:
        srv.runtime = runtime
        yield srv


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _idle(runtime, timeout=10.0) -> None:
    deadline = time.monotonic() + timeout
    while runtime.engine.has_work() or runtime.engine.pool.stats().live_blocks:
        assert time.monotonic() < deadline, "requests still live"
        time.sleep(0.02)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_completion_with_the_openai_client(client):
    out = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens > 0
    assert isinstance(out.choices[0].text, str)


def test_streaming_completion_equals_non_streaming(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_with_the_openai_client_streaming_and_not(client):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=8, temperature=0, extra_body={"min_tokens": 8})
    out = client.chat.completions.create(**kw)
    assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt="abc", max_tokens=10, temperature=1.0, top_p=0.9, seed=7, extra_body={"ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_stop_string_ends_the_completion(server, client):
    kw = dict(model=MODEL, prompt="Hello", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 6
    stop = full[3:6]
    needed = next(k for k in range(1, 21)  # tokens up to the one that completes the stop string
                  if stop in client.completions.create(**{**kw, "max_tokens": k}).choices[0].text)
    resp = client.completions.create(stop=[stop], **kw)
    out = resp.choices[0]
    assert out.text == full[: full.find(stop)] and out.finish_reason == "stop"
    # the engine ends the request in the step whose token completes the stop string, so neither the usage
    # nor the realized length in the log (what the bucket manager learns) carries extra tokens
    _idle(server.runtime)
    row = json.loads(server.runtime.engine.length_log.path.read_text().splitlines()[-1])
    assert resp.usage.completion_tokens == needed and row["output_tokens"] == needed and row["finished"]
    # before min_tokens a stop string does not count (vLLM's semantics), in the text and in the engine
    late = client.completions.create(stop=[stop], **{**kw, "extra_body": {"ignore_eos": True, "min_tokens": needed + 2}})
    assert late.usage.completion_tokens >= needed + 2
    assert late.choices[0].text.startswith(full[: full.find(stop) + len(stop)])


@pytest.mark.parametrize(
    "path,body,status,match",
    [
        ("/v1/completions", "{not json", 400, "JSON"),
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "not served"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "cap"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "empty"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "empty"),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 99}, 400, "n: must be <= 16"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**7]}, 400, "token ids"),
        ("/v1/completions", {"model": MODEL, "prompt": "word " * 3000, "max_tokens": 200}, 400, "cannot fit|context"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ],
)
def test_bad_requests_get_a_clear_4xx(server, path, body, status, match):
    import re

    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(server.url + path, headers={"content-type": "application/json"}, timeout=30, **kw)
    assert r.status_code == status, r.text
    assert re.search(match, r.json()["error"]["message"]), r.json()
    _idle(server.runtime)


def test_queue_full_gets_429_with_retry_after(server):
    old = server.runtime.max_queue
    server.runtime.max_queue = 0
    try:
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    finally:
        server.runtime.max_queue = old
    assert r.status_code == 429 and r.headers["retry-after"] == "1"


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_and_frees_the_block(server, stream, monkeypatch):
    engine = server.runtime.engine
    run = engine.runner.run

    def slow_run(work):  # >= 5 s for 250 tokens: the client's 1 s timeout always comes first
        time.sleep(0.02)
        return run(work)

    monkeypatch.setattr(engine.runner, "run", slow_run)
    before = engine.metrics.finished.get("abort", 0)
    body = {"model": MODEL, "prompt": "long story", "max_tokens": 250, "ignore_eos": True, "stream": stream}
    leave_early(server.url, body, timeout=1.0)
    deadline = time.monotonic() + 20
    while engine.metrics.finished.get("abort", 0) == before:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.05)
    _idle(server.runtime)
    assert engine.pool.stats().live_blocks == 0



def test_metrics_expose_the_engine(server, client):
    client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name in ("odma_queue_depth", "odma_running_requests", "odma_kv_reserved_bytes", "odma_kv_live_bytes",
                 "odma_bucket_bound_tokens", "odma_migrations_total", "odma_reservation_refusals_total",
                 "odma_preemptions_total", "odma_predictor_latency_seconds_bucket", "odma_ttft_seconds_bucket",
                 "odma_tpot_seconds_bucket", "odma_predictor_info", "odma_http_refusals_total", "odma_engine_steps_total",
                 "odma_engine_busy_seconds_total", "odma_engine_decode_tokens_total", "odma_engine_prefill_tokens_total"):
        assert name in text, name
    assert 'odma_predictor_info{fallback="0",name="running-median"' in text


def test_realized_lengths_are_logged_as_a_trace(server, client):
    from odma.traces import load_trace

    client.completions.create(model=MODEL, prompt="log me", max_tokens=5, extra_body={"ignore_eos": True})
    path = server.runtime.engine.length_log.path
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows and rows[-1]["output_tokens"] == 5 and rows[-1]["prompt"] == "log me"
    trace = load_trace(str(path))
    assert trace.records[-1].output_tokens == 5


def test_chat_depth_and_system_prompt_reach_the_length_log(server, client):
    """A chat request tells the predictor how deep the conversation is and which system prompt it runs under;
    the same system text gets the same id, another text another, none gets none."""
    path = server.runtime.engine.length_log.path

    def chat(messages):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0.25,
                                       extra_body={"ignore_eos": True})
        return json.loads(path.read_text().splitlines()[-1])

    system = {"role": "system", "content": "Answer in one word."}
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
             {"role": "user", "content": "Capital of France?"}]
    deep = chat([system, *turns])
    first = chat([system, turns[0]])
    other = chat([{"role": "system", "content": "Be verbose."}, turns[0]])
    bare = chat([turns[0]])
    long_reply = "Paris is the capital and largest city of France, on the Seine."
    deeper = chat([*turns, {"role": "assistant", "content": long_reply}, {"role": "user", "content": "And Spain?"}])
    assert (deep["depth"], first["depth"], bare["depth"], deeper["depth"]) == (1, 0, 0, 2)
    count = lambda text: len(server.runtime.engine.tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    assert deep["prior_output_tokens"] == deep["last_output_tokens"] == count("Hello")
    assert first["prior_output_tokens"] is None and first["last_output_tokens"] is None
    assert deeper["prior_output_tokens"] == (count("Hello") + count(long_reply)) / 2 > count("Hello")
    assert deeper["last_output_tokens"] == count(long_reply)
    assert deep["system_prompt_id"] == first["system_prompt_id"] != other["system_prompt_id"]
    assert deep["system_prompt_id"].startswith("sys-") and bare["system_prompt_id"] is None
    assert deep["temperature"] == 0.25 and deep["generator"] == server.runtime.engine.generator
    assert deep["prompt"] == "Capital of France?"  # the last user turn is what the predictor reads
