"""What a vLLM user expects of the API: n > 1 (each sample its own block, the prompt computed once), logprobs
and top_logprobs, echo with prompt log-likelihoods (`max_tokens: 0, echo: true, logprobs: 1`, as evaluation
harnesses score), sampling defaults from generation_config.json with vLLM's flags, a quiet start."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import torch

from odma.server.generation_config import SamplingDefaults, load_sampling_defaults
from odma.server.testing import MODEL, tiny_model_folder, tiny_server
from odma.errors import ConfigError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def srv(folder):
    with tiny_server(folder) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def post(srv, path: str, body: dict) -> dict:
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def events(srv, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


# -- n > 1 ------------------------------------------------------------------------------------------------

def test_n_samples_each_like_a_single_request_seeded_seed_plus_i(srv):
    engine = srv.runtime.engine
    body = {"model": MODEL, "prompt": "The river flows", "max_tokens": 10, "temperature": 1.0, "seed": 40,
            "ignore_eos": True}
    before_prefill, before_copies = engine.prefill_tokens, engine.forks.copied
    out = post(srv, "/v1/completions", {**body, "n": 3})
    prompt_tokens = out["usage"]["prompt_tokens"]
    assert engine.prefill_tokens - before_prefill == prompt_tokens  # the prompt was computed once...
    assert engine.forks.copied - before_copies == 2  # ...and copied into the other two samples' blocks
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["completion_tokens"] == 30
    singles = [post(srv, "/v1/completions", {**body, "seed": 40 + i})["choices"][0]["text"] for i in range(3)]
    assert [c["text"] for c in out["choices"]] == singles
    assert len(set(singles)) > 1


def test_n_samples_stream_each_choice_to_its_end(srv):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 8, "n": 2,
            "temperature": 1.0, "seed": 3, "ignore_eos": True}
    whole = post(srv, "/v1/chat/completions", body)
    chunks = events(srv, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    texts, reasons = {0: "", 1: ""}, {}
    for c in chunks:
        for choice in c["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
            if choice["finish_reason"]:
                reasons[choice["index"]] = choice["finish_reason"]
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert reasons == {0: "length", 1: "length"}
    assert chunks[-1]["usage"]["completion_tokens"] == 16


def test_guidellm_request_body_streams_usage_in_every_chunk(srv):
    """guidellm (the standard load tool) sends vLLM's stream_options.continuous_usage_stats with ignore_eos and
    stop: null; every chunk then carries the usage so far, growing to the final count."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count"}], "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "stop": None,
            "ignore_eos": True}
    chunks = events(srv, "/v1/chat/completions", body)
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    completions = [u["completion_tokens"] for u in usages]
    assert completions == sorted(completions) and completions[0] == 0 and completions[-1] == 6
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    plain = events(srv, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert [c["usage"] is None for c in plain] == [True] * (len(plain) - 1) + [False]  # usage only at the end


def test_the_openai_client_gets_n_choices_with_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, n=2,
                                         temperature=0.8, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    assert len(out.choices) == 2
    for choice in out.choices:
        assert len(choice.logprobs.content) == 5 and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    text = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, n=3, temperature=0.8, logprobs=2)
    assert [c.index for c in text.choices] == [0, 1, 2] and all(len(c.logprobs.tokens) <= 4 for c in text.choices)


# -- echo and prompt log-likelihoods ------------------------------------------------------------------------

def _hf_logprobs(folder, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_with_max_tokens_0_scores_the_prompt(srv, folder):
    prompt = "The capital of France is Paris"
    out = post(srv, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
    choice = out["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    ids = srv.runtime.engine.tokenizer.encode(prompt, add_special_tokens=False)
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = _hf_logprobs(folder, ids)
    want = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]
    # the server's fp16 KV (its CPU default) rounds K and V to 11 significant bits: ~2e-4 off fp32 transformers here
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-3)
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"][1:])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]


def test_echo_with_generation_prepends_the_prompt(srv):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    plain = post(srv, "/v1/completions", body)["choices"][0]["text"]
    echoed = post(srv, "/v1/completions", {**body, "echo": True, "logprobs": 0})["choices"][0]
    assert echoed["text"] == "Once upon a time" + plain
    n_prompt = len(srv.runtime.engine.tokenizer.encode("Once upon a time", add_special_tokens=False))
    assert len(echoed["logprobs"]["tokens"]) == n_prompt + 5
    chunks = events(srv, "/v1/completions", {**body, "echo": True, "logprobs": 0})
    assert chunks[0]["choices"][0]["text"] == "Once upon a time"
    streamed = [c["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in streamed) == echoed["text"]
    tokens = [t for c in streamed if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert tokens == echoed["logprobs"]["tokens"]


def test_echo_of_token_ids(srv):
    ids = srv.runtime.engine.tokenizer.encode("Hello world", add_special_tokens=False)
    out = post(srv, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert out["choices"][0]["text"] == "Hello world"
    assert len(out["choices"][0]["logprobs"]["token_logprobs"]) == len(ids)


# -- sampling defaults ------------------------------------------------------------------------------------

def test_sampling_defaults_fill_what_a_request_leaves_out(folder):
    with tiny_server(folder, defaults=SamplingDefaults(temperature=0.0, max_tokens=7, source="test")) as srv:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
        a, b = post(srv, "/v1/chat/completions", body), post(srv, "/v1/chat/completions", body)
        assert a["usage"]["completion_tokens"] == 7  # the default max_tokens
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]  # greedy by default
        explicit = post(srv, "/v1/chat/completions", {**body, "temperature": 1.5, "seed": 1, "max_tokens": 7})
        assert explicit["usage"]["completion_tokens"] == 7


def test_generation_config_auto_vllm_and_override(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 4096, "repetition_penalty": 1.1,
         "eos_token_id": 2}))
    with caplog.at_level(logging.WARNING):
        auto = load_sampling_defaults("auto", tmp_path, None, max_tokens_cap=2048)
    assert (auto.temperature, auto.top_p, auto.top_k, auto.max_tokens) == (0.6, 0.9, 20, 2048)
    assert "repetition_penalty=1.1" in caplog.text and "ignored" in caplog.text
    assert "generation_config.json" in auto.source
    assert load_sampling_defaults("vllm", tmp_path) == SamplingDefaults(source=load_sampling_defaults("vllm", tmp_path).source)
    over = load_sampling_defaults("auto", tmp_path, '{"temperature": 0.2}')
    assert over.temperature == 0.2 and over.top_p == 0.9 and "override" in over.source
    assert load_sampling_defaults(str(tmp_path), None).temperature == 0.6  # a folder named explicitly
    for bad in ('{"repetition_penalty": 1.2}', '{"temperature": 3}', "[1]", "{not json"):
        with pytest.raises(ConfigError):
            load_sampling_defaults("auto", tmp_path, bad)
    with pytest.raises(ConfigError):
        load_sampling_defaults(str(tmp_path / "missing"), None)
    assert load_sampling_defaults("auto", tmp_path / "missing").temperature == 1.0


def test_the_embedded_model_samples_as_its_model_card_recommends(tmp_path):
    """SmolLM2-135M-Instruct's file sets no sampling: at OpenAI's temperature 1 README's example rambled. The
    embedded model gets its card's recommendation; the file's own values, `vllm` and the override still rule."""
    from types import SimpleNamespace

    from odma.engine import EngineConfig
    from odma.models.weights import SMOLLM2_SAMPLING
    from odma.server.generation_config import engine_sampling_defaults

    config_file = tmp_path / "generation_config.json"
    config_file.write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))  # what SmolLM2's sets
    embedded = SimpleNamespace(config=EngineConfig(model="smollm2", length_log=None), model_folder=tmp_path)
    auto = engine_sampling_defaults(embedded, "auto")
    assert (auto.temperature, auto.top_p) == (SMOLLM2_SAMPLING["temperature"], SMOLLM2_SAMPLING["top_p"]) == (0.2, 0.9)
    assert "SmolLM2-135M-Instruct's model card (temperature=0.2 top_p=0.9)" in auto.describe(256)
    assert engine_sampling_defaults(embedded, "vllm").temperature == 1.0
    over = engine_sampling_defaults(embedded, "auto", '{"temperature": 0.7}')
    assert (over.temperature, over.top_p) == (0.7, 0.9)
    config_file.write_text(json.dumps({"temperature": 0.5}))  # a value the file sets comes first
    mixed = engine_sampling_defaults(embedded, "auto")
    assert (mixed.temperature, mixed.top_p) == (0.5, 0.9) and "generation_config.json" in mixed.source
    other = SimpleNamespace(config=EngineConfig(model=str(tmp_path), length_log=None), model_folder=tmp_path)
    assert (engine_sampling_defaults(other, "auto").temperature, engine_sampling_defaults(other, "auto").top_p) == (0.5, 1.0)


def test_start_up_says_which_defaults_are_in_force(folder, caplog):
    from odma.engine import EngineConfig
    from odma.server.cli import build_server

    config = EngineConfig(model=str(folder), kv_budget="4MiB", length_log=None, predictor="median", threads=1,
                          max_tokens_cap=64, default_max_tokens=16)
    with caplog.at_level(logging.INFO, logger="odma.serve"):
        build_server(config, override_generation_config='{"temperature": 0.3}')
    assert "sampling defaults for requests that leave them out: temperature=0.3" in caplog.text


# -- a quiet start ----------------------------------------------------------------------------------------

def test_library_info_logs_stay_quiet_unless_debugging(capsys):
    from odma.server.cli import configure_logging

    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    try:
        root.handlers.clear()
        configure_logging("info")
        logging.getLogger().info("Quantization parameters for tensor x not specified")  # onnxruntime's style
        logging.getLogger("predictor.onnx_runtime").info("built the encoder predictor graph in 7.4 s")
        err = capsys.readouterr().err
        assert "built the encoder predictor graph" in err and "Quantization" not in err
        root.handlers.clear()
        configure_logging("debug")
        logging.getLogger().info("Quantization parameters for tensor x not specified")
        assert "Quantization" in capsys.readouterr().err
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
        for name in ("odma", "predictor", "backends", "training", "uvicorn"):
            logging.getLogger(name).setLevel(logging.NOTSET)
