"""Several prompts in one completions request (OpenAI's batch form; lm-eval sends it with batch_size > 1): each
prompt's n samples are choices prompt index * n + sample, each answered as the prompt alone would be; one bad
prompt refuses the whole request with nothing run; a client that leaves cancels every prompt's samples."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch

from odma.server.admission import Door
from odma.server.testing import MODEL, leave_early, tiny_model_folder, tiny_process_server, tiny_server

torch.set_num_threads(1)

PROMPTS = ["The capital of France is", "One, two, three,", "Once upon a time"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def srv(request, folder):
    start = tiny_server if request.param == "in-process" else tiny_process_server
    with start(folder) as server:
        yield server


def _post(srv, body: dict) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)


def _idle(srv, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while srv.runtime.waiting or srv.runtime.stats().running:
        assert time.monotonic() < deadline, "samples still queued or running"
        time.sleep(0.05)


def test_each_prompt_of_a_batch_is_answered_as_alone(srv):
    kw = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    alone = [_post(srv, {"prompt": p, **kw}).json() for p in PROMPTS]
    r = _post(srv, {"prompt": PROMPTS, "n": 2, **kw})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(2 * len(PROMPTS)))
    for i, one in enumerate(alone):
        for j in range(2):
            assert body["choices"][2 * i + j]["text"] == one["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert body["usage"]["completion_tokens"] == 2 * len(PROMPTS) * 6
    _idle(srv)


def test_a_streamed_batch_carries_every_choice_to_its_end(srv):
    kw = {"prompt": PROMPTS, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    whole = _post(srv, kw).json()
    texts, ends, usage = {}, {}, None
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, **kw}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                if c["finish_reason"] is not None:
                    ends[c["index"]] = c["finish_reason"]
            usage = chunk.get("usage") or usage
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert ends == {i: "length" for i in range(len(PROMPTS))}
    assert usage == whole["usage"]


def test_a_batch_of_token_ids_scores_each_prompt_as_alone(srv):
    """lm-eval's loglikelihood requests, batched: echo, logprobs, max_tokens 0."""
    batch = [[504, 3575, 282, 4649], [1782, 28, 827], [9, 10, 11, 12, 13]]
    kw = {"max_tokens": 0, "echo": True, "logprobs": 1}
    alone = [_post(srv, {"prompt": [ids], **kw}).json()["choices"][0] for ids in batch]
    together = _post(srv, {"prompt": batch, **kw}).json()["choices"]
    assert len(together) == len(batch)
    for got, one in zip(together, alone):
        assert got["text"] == one["text"] and got["logprobs"]["tokens"] == one["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(one["logprobs"]["token_logprobs"], abs=1e-4)


@pytest.mark.parametrize("prompt,match", [
    (["fine", [1, 2]], "a list of 1 to 128 of either kind"),  # text and ids mixed
    (["x"] * 129, "a list of 1 to 128 of either kind"),
    (["fine", ""], "a list of 1 to 128"),
    ([[1, 2], [3] * 5000], r"prompt\[1\]: .*context"),
])
def test_one_bad_prompt_refuses_the_batch_and_runs_nothing(srv, prompt, match):
    import re

    _idle(srv)
    before = srv.runtime.stats().prefill_tokens
    r = _post(srv, {"prompt": prompt, "max_tokens": 8})
    assert r.status_code == 400 and re.search(match, r.json()["error"]["message"]), r.text
    assert srv.runtime.waiting == 0  # every place taken at the door given back
    _idle(srv)
    assert srv.runtime.stats().prefill_tokens == before  # not even the good prompts ran


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_cancels_every_prompt_of_its_batch(srv, stream):
    # 24 prompts x 4 samples x 64 tokens: seconds of work on the tiny model, the client gone after half of one
    body = {"model": MODEL, "prompt": [f"{i} {PROMPTS[0]}" for i in range(24)], "n": 4,
            "max_tokens": 64, "ignore_eos": True, "stream": stream}
    _idle(srv)
    before = srv.runtime.stats().decode_tokens
    leave_early(srv.url, body, timeout=0.5)
    _idle(srv)
    stats = srv.runtime.stats()
    assert stats.total("reserved_bytes") == 0
    assert stats.decode_tokens - before < 96 * 64 / 2  # cancelled: not run to its end



def test_a_pass_split_among_prompts_gives_each_place_back_once():
    door = Door(max_queue=8)
    whole = door.admit(6)
    first, second = whole.split(2), whole.split(2)
    assert (first.places, second.places, whole.places, door.waiting) == (2, 2, 2, 6)
    assert whole.split(5).places == 2 and whole.places == 0  # no more than is left
    first.release()
    first.release()
    second.release(1)
    assert door.waiting == 3
    assert door.admit(6) is None and door.admit(5) is not None
