"""Scores an evaluation harness can trust: the server driven the way lm-evaluation-harness' `local-completions`
drives it (log-likelihood: the prompt as token ids, `max_tokens: 1, echo: true, logprobs: 1`, then the sum of
`token_logprobs[ctxlen:-1]`; `generate_until`: greedy text cut at stop strings), with the numbers checked against
transformers on the same weights. The tiny model is edited so that one prompt's greedy next token is EOS, the case
where a missing EOS entry made the harness drop the answer's last real token."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from odma.server.testing import MODEL, tiny_model_folder, tiny_server

torch.set_num_threads(1)

EOS = 2  # tiny_model_folder's EOS (<|im_end|> in SmolLM2's vocabulary)
MESSAGES = [{"role": "user", "content": "Name a river."}]
# a multiple-choice task (lm-eval joins question and choice with " "); the model answers EOS after the first choice
MC_DOCS = [{"question": "The river flows to the", "choices": ["sea", "mountain"], "answer": 0},
           {"question": "Snow is", "choices": ["white", "green"], "answer": 0}]
PAIRS = [(d["question"], " " + c) for d in MC_DOCS for c in d["choices"]]  # (context, continuation)
GEN_DOCS = [{"question": "Q: Name a river.\nA:", "answer": " Nile"},  # generate_until, cut at "\n"
            {"question": "Q: Name a colour.\nA:", "answer": " red"}]
MAX_GEN = 8


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder)).eval()


def _chat_ids(tok) -> list[int]:
    """MESSAGES as the server feeds them: the chat template's text, encoded without special tokens added."""
    return tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


def _pair(tok, context: str, continuation: str) -> tuple[list[int], int]:
    """(token ids of context + continuation, how many are the context's), as lm-eval encodes a pair."""
    whole = tok.encode(context + continuation, add_special_tokens=False)
    return whole, len(tok.encode(context, add_special_tokens=False))


def _answer_eos_after(folder, prompts: list[list[int]]) -> None:
    """Edit the folder's LM head so that the greedy token after each of `prompts` is EOS: EOS's row is the
    combination of the prompts' last hidden states that puts its logit 1 above the top one after each."""
    hf = _hf(folder)
    with torch.no_grad():
        hidden = torch.stack([hf.model(torch.tensor([ids])).last_hidden_state[0, -1] for ids in prompts])
        head = hf.lm_head.weight
        target = (hidden @ head.T).max(dim=-1).values + 1.0
        head[EOS] = hidden.T @ torch.linalg.solve(hidden @ hidden.T, target)
    hf.save_pretrained(str(folder))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tiny_model_folder(tmp_path_factory.mktemp("scoring"))
    tok = AutoTokenizer.from_pretrained(str(folder))
    _answer_eos_after(folder, [_chat_ids(tok), _pair(tok, *PAIRS[0])[0]])
    return folder


@pytest.fixture(scope="module")
def tok(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def hf(folder):
    return _hf(folder)


@pytest.fixture(scope="module")
def srv(folder):
    with tiny_server(folder, max_tokens_cap=32) as s:
        yield s


@pytest.fixture(scope="module")
def ends_at_once(tok) -> list[int]:
    """A prompt whose greedy answer is EOS alone."""
    return _chat_ids(tok)


def _post(srv, path: str, body: dict) -> dict:
    r = httpx.post(srv.url + path, json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


# -- every generated token has its entry, EOS included ------------------------------------------------------

def test_an_eos_answer_has_its_entry_in_completions(srv, hf, ends_at_once):
    body = _post(srv, "/v1/completions", {"prompt": [ends_at_once], "max_tokens": 1, "echo": True, "logprobs": 1,
                                          "temperature": 0})
    choice, usage = body["choices"][0], body["usage"]
    lp = choice["logprobs"]
    assert usage["completion_tokens"] == 1 and choice["finish_reason"] == "stop"
    assert len(lp["token_logprobs"]) == len(ends_at_once) + 1  # the prompt's entries and the EOS entry
    assert lp["tokens"][-1] == "" and lp["text_offset"][-1] == len(choice["text"])
    eos_logprob = _logprobs(hf, ends_at_once)[-1, EOS].item()
    assert lp["token_logprobs"][-1] == pytest.approx(eos_logprob, abs=1e-4)
    assert max(lp["top_logprobs"][-1].values()) == lp["token_logprobs"][-1]  # greedy: EOS is the top token


def test_an_eos_answer_has_its_entry_in_chat(srv, ends_at_once):
    body = _post(srv, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "logprobs": True,
                                               "top_logprobs": 2, "temperature": 0})
    choice = body["choices"][0]
    assert choice["message"]["content"] == "" and body["usage"]["completion_tokens"] == 1
    [entry] = choice["logprobs"]["content"]
    assert entry["token"] == "" and entry["bytes"] == [] and entry["logprob"] <= 0
    assert len(entry["top_logprobs"]) == 2


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streams_send_the_eos_entry(srv, ends_at_once, path):
    body = ({"prompt": [ends_at_once], "logprobs": 0} if path == "/v1/completions"
            else {"messages": MESSAGES, "logprobs": True})
    with httpx.stream("POST", srv.url + path, json={"model": MODEL, "max_tokens": 4, "temperature": 0, "stream": True,
                                                     **body}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    entries = []
    for c in chunks:
        lp = c["choices"][0]["logprobs"] if c["choices"] else None
        if lp:
            entries += lp["content"] if "content" in lp else lp["token_logprobs"]
    assert len(entries) == 1 and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_entries_count_the_completion_tokens(srv, tok):
    body = _post(srv, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12, "logprobs": 1,
                                          "temperature": 1.0, "seed": 3})
    choice = body["choices"][0]
    assert len(choice["logprobs"]["tokens"]) == body["usage"]["completion_tokens"]
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]


# -- an evaluation harness' requests, checked against transformers -----------------------------------------

def _expected_loglikelihood(hf, whole: list[int], ctxlen: int) -> tuple[float, bool]:
    """Sum of the continuation's log-probabilities, and whether it is the greedy continuation."""
    rows = _logprobs(hf, whole)[ctxlen - 1 : len(whole) - 1]
    cont = torch.tensor(whole[ctxlen:])
    return rows.gather(1, cont.unsqueeze(1)).sum().item(), bool((rows.argmax(-1) == cont).all())


def _expected_generation(hf, tok, question: str) -> str:
    ids = tok.encode(question, add_special_tokens=False)
    out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_GEN, do_sample=False, eos_token_id=EOS,
                      pad_token_id=EOS)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True).split("\n")[0]


def test_the_eos_case_is_covered(hf, tok):
    whole, _ = _pair(tok, *PAIRS[0])
    assert _logprobs(hf, whole)[-1].argmax().item() == EOS  # the harness' one generated token is EOS


@pytest.mark.parametrize("context,continuation", PAIRS)
def test_loglikelihood_as_a_harness_asks_matches_transformers(srv, hf, tok, context, continuation):
    """local-completions' request and parsing (lm_eval/models/openai_completions.py, 0.4.x)."""
    whole, ctxlen = _pair(tok, context, continuation)
    body = _post(srv, "/v1/completions", {"prompt": [whole], "temperature": 0, "max_tokens": 1, "logprobs": 1,
                                          "seed": 1234, "echo": True})
    lp = body["choices"][0]["logprobs"]
    scored = lp["token_logprobs"][ctxlen:-1]
    greedy = all(t == max(top.values()) for t, top in zip(scored, lp["top_logprobs"][ctxlen:-1]))
    expected, expected_greedy = _expected_loglikelihood(hf, whole, ctxlen)
    assert len(scored) == len(whole) - ctxlen
    assert sum(scored) == pytest.approx(expected, abs=1e-3) and greedy == expected_greedy


@pytest.mark.parametrize("doc", GEN_DOCS)
def test_generate_until_as_a_harness_asks_matches_transformers(srv, hf, tok, doc):
    ids = tok.encode(doc["question"], add_special_tokens=False)
    body = _post(srv, "/v1/completions", {"prompt": [ids], "max_tokens": MAX_GEN, "temperature": 0,
                                          "stop": ["\n", tok.eos_token], "seed": 1234})
    assert body["choices"][0]["text"] == _expected_generation(hf, tok, doc["question"])


def _task_files(tmp_path) -> Path:
    """Two local lm-eval tasks (a multiple-choice and a generate_until one) over JSONL files in tmp_path."""
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: \"{{question}}\"\n"
    (tmp_path / "odma_mc.yaml").write_text(
        f"task: odma_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (tmp_path / "odma_gen.yaml").write_text(
        f"task: odma_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'gen.jsonl'}\n"
        f"output_type: generate_until\ndoc_to_target: \"{{{{answer}}}}\"\n"
        f"generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: {MAX_GEN}\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    return tmp_path


@pytest.mark.parametrize("batch_size", [1, 4])
def test_lm_eval_local_completions_scores_match_transformers(srv, folder, hf, tok, tmp_path, monkeypatch, batch_size):
    """lm-evaluation-harness itself (the test extra installs it), offline, on two local tasks; with batch_size 4
    it sends several prompts in one request."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(_task_files(tmp_path)), include_defaults=False)
    out = lm_eval.simple_evaluate(
        model="local-completions", tasks=["odma_mc", "odma_gen"], task_manager=tasks, log_samples=True,
        model_args={"model": MODEL, "base_url": srv.url + "/v1/completions", "tokenizer_backend": "huggingface",
                    "tokenizer": str(folder), "max_length": 512, "batch_size": batch_size})
    mc = sorted(out["samples"]["odma_mc"], key=lambda s: s["doc_id"])
    assert len(mc) == len(MC_DOCS)
    for sample, doc in zip(mc, MC_DOCS):
        for (got, greedy), choice in zip(sample["filtered_resps"], doc["choices"]):
            expected, expected_greedy = _expected_loglikelihood(hf, *_pair(tok, doc["question"], " " + choice))
            assert got == pytest.approx(expected, abs=1e-3) and greedy == expected_greedy
    gen = sorted(out["samples"]["odma_gen"], key=lambda s: s["doc_id"])
    assert [s["filtered_resps"][0] for s in gen] == [_expected_generation(hf, tok, d["question"]) for d in GEN_DOCS]
