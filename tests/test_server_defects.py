"""Server defects, each probed from outside as it was found: pathological values, huge seeds, lone
surrogates, tiny temperatures, silently ignored or loosely typed parameters, error shapes. Every error is
OpenAI's error object; nothing reaches the engine in a form that can fail a step; one bad request never ends
another."""

from __future__ import annotations

import json
import math
import re
import threading
import time

import httpx
import pytest
import torch

from odma.server.testing import MODEL, tiny_model_folder, tiny_server

torch.set_num_threads(1)


class ChokesOnThePathological:
    """The default encoder answered NaN for a temperature past float32; this one does for prompts saying so."""

    name = "chokes"

    def predict(self, requests):
        return [(math.nan, 0.5) if "pathological" in (r.prompt or "") else (24.0, 0.2) for r in requests]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def srv(folder):
    with tiny_server(folder, predictor=ChokesOnThePathological()) as s:
        yield s


def post(srv, path: str, body, client: httpx.Client | None = None, **kw) -> httpx.Response:
    """POST raw bytes: `json.dumps` escapes lone surrogates as JSON allows (httpx's json= cannot send them)."""
    content = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode("utf-8", "surrogatepass")
    send = client.post if client is not None else httpx.post
    return send(srv.url + path, content=content, headers={"content-type": "application/json"}, timeout=60, **kw)


def assert_error(r: httpx.Response, status: int, *, param: str | None = None, match: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status and isinstance(body["error"]["message"], str)
    if param is not None:
        assert body["error"]["param"] == param, body
    if match is not None:
        assert re.search(match, body["error"]["message"]), body
    return body["error"]


def chat(content="hi", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw}


def completion(prompt="hi", **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, **kw}


def _idle(srv, timeout=20.0) -> None:
    engine = srv.runtime.engine
    deadline = time.monotonic() + timeout
    while engine.has_work() or engine.pool.stats().live_blocks:
        assert time.monotonic() < deadline, "requests still live"
        time.sleep(0.02)


# -- 1. one request failed every request in flight -------------------------------------------------------

@pytest.mark.parametrize("temperature", [1e39, 3.5e38, 2.0000001, -0.5])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_an_out_of_range_temperature_is_refused_at_the_edge(srv, kind, temperature):
    body = (chat if kind == "chat" else completion)(temperature=temperature)
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    assert_error(post(srv, path, body), 400, param="temperature", match="temperature")


def test_infinity_and_nan_literals_are_refused(srv):
    for literal in ("1e999", "-1e999", "NaN", "Infinity"):
        raw = '{"model": "%s", "prompt": "hi", "max_tokens": 2, "temperature": %s}' % (MODEL, literal)
        assert_error(post(srv, "/v1/completions", raw), 400)


def test_one_pathological_request_cannot_end_another(srv, monkeypatch):
    """Three streams decode while requests the predictor chokes on (and one the edge refuses) arrive: every
    stream ends normally with all its tokens, and the pathological requests are served too."""
    engine = srv.runtime.engine
    run = engine.runner.run

    def paced_run(work):  # >= 10 ms a step: the streams are surely still decoding when the others arrive
        time.sleep(0.01)
        return run(work)

    monkeypatch.setattr(engine.runner, "run", paced_run)
    results: dict[int, tuple[str | None, int]] = {}

    def stream(i: int) -> None:
        body = completion(f"story {i}", max_tokens=60, ignore_eos=True, stream=True,
                          stream_options={"include_usage": True}, temperature=0)
        reason, tokens = None, 0
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    reason = chunk["choices"][0]["finish_reason"]
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        results[i] = (reason, tokens)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while engine.num_running < 3 and time.monotonic() < deadline:
        time.sleep(0.005)  # the streams are decoding
    first = post(srv, "/v1/completions", completion("pathological prompt", max_tokens=4, ignore_eos=True))
    overlapped = engine.num_running >= 3  # the streams outlived the pathological request
    odd = [first, post(srv, "/v1/chat/completions", chat("pathological chat", ignore_eos=True, max_tokens=4)),
           post(srv, "/v1/completions", completion("x", temperature=1e39))]
    for t in threads:
        t.join(timeout=120)
    assert overlapped
    assert results == {i: ("length", 60) for i in range(3)}
    assert [r.status_code for r in odd] == [200, 200, 400]
    assert odd[0].json()["usage"]["completion_tokens"] == 4
    assert srv.runtime.loop_errors == 0 and engine.rejected_predictions >= 2
    monkeypatch.undo()
    _idle(srv)


# -- 2. large seeds ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", ["18446744073709551616", "-9223372036854775809", "1" + "0" * 30, "18446744073709551615"])
def test_seeds_beyond_int64_get_a_400_and_the_connection_survives(srv, seed):
    with httpx.Client(timeout=60) as client:
        raw = '{"model": "%s", "prompt": "hi", "max_tokens": 2, "seed": %s}' % (MODEL, seed)
        assert_error(post(srv, "/v1/completions", raw, client), 400, param="seed")
        assert post(srv, "/v1/completions", completion(max_tokens=2), client).status_code == 200


@pytest.mark.parametrize("seed", [-(2**63), 2**63 - 1, 0, -2])
def test_int64_seeds_are_accepted_and_reproducible(srv, seed):
    body = completion(max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True)
    a, b = post(srv, "/v1/completions", body), post(srv, "/v1/completions", body)
    assert a.status_code == 200 and a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]


# -- 3. lone surrogates -----------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", chat("hi \ud800 there"), "messages.0.content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "system", "content": "sys \udfff"},
                                                           {"role": "user", "content": "hi"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"},
                                                           {"role": "assistant", "content": "x\ud83d"},
                                                           {"role": "user", "content": "b"}]}, "messages.1.content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content"),
    ("/v1/completions", completion("abc\ud800"), "prompt"),
    ("/v1/completions", completion(["abc\udc00"]), "prompt"),
    ("/v1/completions", completion(stop=["\ud800"]), "stop"),
    ("/v1/completions", completion(user="\ud800"), "user"),
])
def test_a_lone_surrogate_gets_a_400_naming_the_field(srv, path, body, param):
    err = assert_error(post(srv, path, body), 400, param=param, match="surrogate")
    assert param in err["message"]


# -- 4. tiny temperatures ---------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1e-39, 1e-45, 1e-300])
def test_a_tiny_temperature_is_greedy(srv, temperature):
    greedy = post(srv, "/v1/completions", completion("Once upon", max_tokens=12, temperature=0, ignore_eos=True))
    tiny = post(srv, "/v1/completions", completion("Once upon", max_tokens=12, temperature=temperature, seed=5,
                                                   ignore_eos=True))
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


# -- 5. parameters honoured or refused, never dropped; strict types ----------------------------------------

@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", completion(max_tokens="5"), "max_tokens"),
    ("/v1/completions", completion(max_tokens=5.0), "max_tokens"),
    ("/v1/completions", completion(max_tokens=True), "max_tokens"),
    ("/v1/completions", completion([True, False]), "prompt"),
    ("/v1/completions", completion(["a", [1, 2]]), "prompt"),  # a batch mixing text and token ids
    ("/v1/completions", completion(best_of=2), "best_of"),
    ("/v1/completions", completion(suffix="tail"), "suffix"),
    ("/v1/completions", completion(logprobs=21), "logprobs"),
    ("/v1/completions", completion(logprobs=True), "logprobs"),
    ("/v1/completions", completion(frequency_penalty=2.5), "frequency_penalty"),
    ("/v1/completions", completion(presence_penalty=-3), "presence_penalty"),
    ("/v1/completions", completion(frequency_penalty="1"), "frequency_penalty"),
    ("/v1/completions", completion(logit_bias={"50": 101}), "logit_bias.50"),
    ("/v1/completions", completion(logit_bias={"50": "1"}), "logit_bias.50"),
    ("/v1/completions", completion(logit_bias={"x": 1}), None),  # not a token id
    ("/v1/completions", completion(logit_bias={"050": 1}), None),
    ("/v1/completions", completion(logit_bias={"99999999": 1}), None),  # outside the vocabulary
    ("/v1/completions", completion(repetition_penalty=1.1), "repetition_penalty"),
    ("/v1/completions", completion(n="2"), "n"),
    ("/v1/completions", completion(stream="yes"), "stream"),
    ("/v1/completions", completion(seed=1.0), "seed"),
    ("/v1/completions", completion(min_tokens=9), None),
    ("/v1/chat/completions", chat(top_logprobs=21, logprobs=True), "top_logprobs"),
    ("/v1/chat/completions", chat(top_logprobs=3), None),
    ("/v1/chat/completions", chat(logprobs=1), "logprobs"),
    ("/v1/chat/completions", chat(response_format={"type": "json_object"}), "response_format.type"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    ("/v1/chat/completions", chat(tool_choice="required"), "tool_choice"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "assistant", "content": None, "tool_calls": []}]},
     "messages.0.tool_calls"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "system", "content": None},
                                                           {"role": "user", "content": "x"}]}, "messages.0.content"),
])
def test_unsupported_or_loosely_typed_parameters_are_refused(srv, path, body, param):
    assert_error(post(srv, path, body), 400, param=param)


def test_parameters_at_their_defaults_are_accepted(srv):
    ok = completion(best_of=1, suffix="", frequency_penalty=0, presence_penalty=0.0, logit_bias={}, user="u", n=1,
                    echo=False, logprobs=None, stream=False, seed=None, stop=None, top_k=-1)
    assert post(srv, "/v1/completions", ok).status_code == 200
    ok = chat(response_format={"type": "text"}, tools=[], tool_choice="none", parallel_tool_calls=False, logprobs=False,
              top_logprobs=0, stream_options=None)
    assert post(srv, "/v1/chat/completions", ok).status_code == 200


def test_chat_logprobs_are_honoured(srv):
    r = post(srv, "/v1/chat/completions", chat("Hello", max_tokens=6, logprobs=True, top_logprobs=5, ignore_eos=True,
                                               temperature=0))
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 6 and "".join(c["token"] for c in content) == choice["message"]["content"]
    for c in content:
        assert len(c["top_logprobs"]) == 5 and c["top_logprobs"][0]["token"] == c["token"]  # greedy: the top one
        assert c["logprob"] <= 0 and bytes(c["bytes"]).decode("utf-8", "replace")


def test_a_logit_bias_key_that_is_no_token_id_says_so(srv):
    for key in ("x", "050", "49152"):
        err = assert_error(post(srv, "/v1/completions", completion(logit_bias={key: 1})), 400,
                           match="is not a token id of this model's vocabulary")
        assert err["param"].startswith(f"logit_bias.{key}"), err


def test_penalties_and_logit_bias_are_honoured(srv):
    def tokens(**kw) -> list[str]:
        r = post(srv, "/v1/completions", completion([5, 6, 7], logprobs=0, ignore_eos=True, temperature=0,
                                                     **{"max_tokens": 12, **kw}))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    plain = tokens()
    forced = tokens(logit_bias={"77": 100})
    assert len(set(forced)) == 1 and forced != plain
    # 2 a time it occurs: the bias of 100 stops winning after ~50 of them (the model's own logits are small)
    penalized = tokens(logit_bias={"77": 100}, frequency_penalty=2, presence_penalty=1, max_tokens=64)
    assert penalized[:40] == forced[:1] * 40 and len(set(penalized)) > 1


def test_completion_logprobs_zero_reports_the_chosen_token_only(srv):
    r = post(srv, "/v1/completions", completion("Hello", max_tokens=4, logprobs=0, ignore_eos=True, temperature=0))
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert all(len(top) == 1 for top in lp["top_logprobs"])
    assert "".join(lp["tokens"]) == r.json()["choices"][0]["text"]


# -- 6. one error shape for every 4xx/5xx -----------------------------------------------------------------

def test_a_body_that_is_not_utf8_gets_the_openai_error(srv):
    assert_error(post(srv, "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}'), 400, match="UTF-8|parsed")


def test_deeply_nested_json_gets_the_openai_error(srv):
    deep = b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert_error(post(srv, "/v1/completions", deep), 400)
    assert_error(post(srv, "/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000), 400)


def test_routing_errors_get_the_openai_error(srv):
    assert_error(httpx.get(srv.url + "/v1/nothing"), 404)
    r = httpx.delete(srv.url + "/v1/completions")
    assert_error(r, 405)
    assert "POST" in r.headers["allow"]
    assert_error(post(srv, "/v1/completions", "{not json"), 400, match="JSON")
    assert_error(post(srv, "/v1/completions", completion(model="nope")), 404, param="model")


def test_a_failing_engine_step_gets_the_openai_error(srv, monkeypatch):
    engine = srv.runtime.engine

    def broken(work):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "run", broken)
    err = assert_error(post(srv, "/v1/completions", completion()), 500)
    assert err["type"] == "server_error" and "device lost" in err["message"]
    monkeypatch.undo()
    _idle(srv)
    assert post(srv, "/v1/completions", completion()).status_code == 200


# -- 10. the fragmentation gauge on an idle server --------------------------------------------------------

def test_an_idle_server_reports_no_fragmentation(srv):
    for i in range(6):
        post(srv, "/v1/completions", completion(f"warm {i}", max_tokens=3 + 5 * i, ignore_eos=True))
    _idle(srv)
    text = httpx.get(srv.url + "/metrics").text
    [value] = re.findall(r"^odma_kv_external_fragmentation (\S+)$", text, re.M)
    assert float(value) == 0.0 and srv.runtime.engine.pool.stats().cached_tokens > 0


def test_a_message_without_content_is_refused_except_an_assistant_turn(srv):
    err = assert_error(post(srv, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}), 400)
    assert err["message"] == "messages.0.content: required", err
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": "and?"}]
    assert post(srv, "/v1/chat/completions", {"model": MODEL, "messages": turns, "max_tokens": 4}).status_code == 200
