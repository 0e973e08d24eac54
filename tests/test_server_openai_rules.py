"""What OpenAI's API and vLLM refuse is refused here too (stream_options without streaming, a tool message without
the call it answers), what they answer is answered (one model by its id), a reply cut inside a character does
not end in U+FFFD, and a body that is not a JSON object gets a message saying what is wrong with it."""

from __future__ import annotations

import httpx
import pytest
import torch

from odma.server.testing import MODEL, tiny_server

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def srv(tiny_folder):
    with tiny_server(tiny_folder) as s:
        yield s


def _error(r: httpx.Response, param: str | None = None) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_stream_options_need_stream_true(srv, path, body):
    options = {"include_usage": True}
    for stream in (False, None):
        message = _error(httpx.post(srv.url + path, json={**body, "stream": stream, "stream_options": options}),
                         "stream_options")
        assert "stream: true" in message
    assert httpx.post(srv.url + path, json={**body, "stream_options": options}).status_code == 400
    assert httpx.post(srv.url + path, json={**body, "stream_options": None}).status_code == 200  # left out
    assert httpx.post(srv.url + path, json={**body, "stream": True, "stream_options": options}).status_code == 200


def test_a_tool_message_needs_the_id_of_the_call_it_answers(srv):
    messages = [{"role": "user", "content": "weather?"}, {"role": "tool", "content": "sunny"}]
    message = _error(httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "messages": messages}),
                     "messages.1.tool_call_id")
    assert "required" in message
    messages[1]["tool_call_id"] = "call_1"
    assert httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "messages": messages}).status_code == 200


def test_one_model_is_retrieved_by_its_id(srv):
    [listed] = httpx.get(srv.url + "/v1/models").json()["data"]
    r = httpx.get(srv.url + f"/v1/models/{MODEL}")
    assert r.status_code == 200 and r.json() == listed
    for other in ("nope", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        r = httpx.get(srv.url + f"/v1/models/{other}")
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("content_type,body,says", [
    ("text/plain", b'{"model": "tiny", "prompt": "hi"}', "content-type: application/json"),
    (None, b'{"model": "tiny", "prompt": "hi"}', "content-type"),
    ("application/x-www-form-urlencoded", b"model=tiny&prompt=hi", "content-type"),
    ("application/json", b"[1, 2]", "JSON object, not an array"),
    ("application/json", b"5", "JSON object, not a number"),
    ("application/json", b"null", "JSON object, not null"),
    ("application/json", b"", "empty"),
    ("application/json; charset=utf-8", b'"hi"', "JSON object, not a string"),
])
def test_a_body_that_is_not_a_json_object_says_what_is_wrong(srv, content_type, body, says):
    headers = {"content-type": content_type} if content_type else {}
    message = _error(httpx.post(srv.url + "/v1/completions", content=body, headers=headers))
    assert says in message and "dictionary" not in message


def test_a_reply_cut_inside_a_character_ends_before_it(tiny_folder):
    """Byte-level BPE splits a CJK character over tokens: a reply whose max_tokens ends inside one holds the
    partial bytes back (vLLM's detokenizer does) instead of ending in U+FFFD."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from odma.server.streams import TextStream

    tok = AutoTokenizer.from_pretrained(str(tiny_folder))
    ids = tok.encode("Tokyo 東京", add_special_tokens=False)
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    assert cuts, "the text must have a character spread over tokens"
    engine = SimpleNamespace(decode=lambda t: tok.decode(t, skip_special_tokens=True))
    for k in cuts:
        stream = TextStream(engine, stops=())
        text = "".join(stream.push(t) for t in ids[:k]) + stream.flush()
        assert "\ufffd" not in text
        assert text == tok.decode(ids[:k]).removesuffix("\ufffd")
