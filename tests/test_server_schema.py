"""/openapi.json describes what the server does, and schemathesis (every check, positive and negative cases,
bounded: fixed seed and example count, max_tokens capped at 8, the tiny model) finds nothing: no 5xx, no
schema-valid request refused, no schema-violating request accepted, every response as documented."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch

from odma.server.testing import tiny_model_folder, tiny_server

torch.set_num_threads(1)
CAP = 8  # max_tokens cap of the server under test: bounds the time every generated case takes


class StatusCounter:
    """ASGI middleware counting response statuses (what the server sent, whatever the client concluded)."""

    def __init__(self, app) -> None:
        self.app, self.statuses = app, Counter()

    async def __call__(self, scope, receive, send):
        async def counted(message):
            if message["type"] == "http.response.start":
                self.statuses[message["status"]] += 1
            await send(message)

        await self.app(scope, receive, counted)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    folder = tiny_model_folder(tmp_path_factory.mktemp("tiny"))
    counters = []

    def wrap(app):
        counters.append(StatusCounter(app))
        return counters[-1]

    with tiny_server(folder, max_tokens_cap=CAP, default_max_tokens=CAP, max_n=2, wrap=wrap) as s:
        s.statuses = counters[0].statuses
        yield s


@pytest.fixture(scope="module")
def spec(srv):
    return httpx.get(srv.url + "/openapi.json").json()


def test_the_schema_declares_what_the_server_sends(spec):
    assert spec["openapi"] == "3.0.3"  # as OpenAI's: `type: integer` excludes 5.0
    for path, item in spec["paths"].items():
        for method, op in item.items():
            assert "422" not in op["responses"], (method, path)
            assert "500" in op["responses"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert {"200", "400", "404", "413", "429", "500"} <= set(responses)
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert responses["429"]["headers"]["Retry-After"]["required"] is True
        for status in ("400", "404", "429", "500"):
            assert responses[status]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert set(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "HTTPValidationError" not in spec["components"]["schemas"]


def test_the_schema_carries_the_enforced_limits(spec):
    completion = spec["components"]["schemas"]["CompletionRequest"]
    props = completion["properties"]
    assert completion["additionalProperties"] is False  # unknown parameters are refused
    assert (props["max_tokens"]["minimum"], props["max_tokens"]["maximum"]) == (0, CAP)
    assert (props["n"]["minimum"], props["n"]["maximum"]) == (1, 2)
    assert (props["seed"]["minimum"], props["seed"]["maximum"]) == (-(2**63), 2**63 - 1)  # exact, not floats
    assert (props["temperature"]["minimum"], props["temperature"]["maximum"]) == (0, 2)
    assert props["logprobs"]["maximum"] == 20 and props["model"]["enum"][0] == "tiny"
    assert props["frequency_penalty"]["maximum"] == 2 and props["best_of"]["maximum"] == 1
    bias = props["logit_bias"]  # its keys: the vocabulary's token ids
    assert bias["additionalProperties"] is False and list(bias["patternProperties"].values())[0]["maximum"] == 100
    key = re.compile(next(iter(bias["patternProperties"])))
    assert key.match("0") and key.match("49151") and not key.match("49152") and not key.match("07")
    token_ids = next(b for b in props["prompt"]["anyOf"] if b.get("items", {}).get("type") == "integer")
    assert token_ids["items"]["maximum"] == 49151
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["properties"]["max_completion_tokens"]["maximum"] == CAP
    assert len(chat["allOf"]) == 2 and completion["anyOf"]  # the cross-field rules: stream_options, top_logprobs


def test_schemathesis_finds_nothing(srv, tmp_path):
    exe = Path(sys.executable).parent / "schemathesis"
    if not exe.exists():
        pytest.skip("schemathesis is not installed (pip install -e '.[test]')")
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
           "PYTHONPATH": str(Path(__file__).parent), "NO_COLOR": "1"}
    cmd = [str(exe), "run", srv.url + "/openapi.json", "--checks", "all", "--mode", "all", "--max-examples", "60",
           "--seed", "24", "--workers", "1", "--request-timeout", "60", "--generation-database", "none", "--no-color"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    report = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, report
    statuses = srv.statuses
    assert not [s for s in statuses if s >= 500], statuses
    assert statuses[200] >= 100 and statuses[400] >= 100, statuses  # both kinds of case reached the server
    engine = srv.runtime.engine
    assert srv.runtime.loop_errors == 0 and engine.errors == 0
    deadline = time.monotonic() + 30  # a stream the client closed early is cancelled at the next step
    while engine.has_work() or engine.pool.stats().live_blocks:
        assert time.monotonic() < deadline, "requests still live after the run"
        time.sleep(0.05)
    engine.pool.check_invariants()
    print(f"schemathesis: {sorted(statuses.items())}")
