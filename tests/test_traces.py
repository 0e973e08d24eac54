"""Trace loaders, the generic JSONL format, and deterministic splits by prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from odma.config import default_data_dir
from odma.errors import TraceError
from odma.traces import Trace, TraceRecord, load_trace, normalized_prompt, split_trace, write_jsonl_trace

FIXTURES = Path(__file__).resolve().parent.parent / "datasets" / "fixtures"
needs_shared = pytest.mark.skipif(not default_data_dir().exists(), reason="shared datasets not present")


def test_generic_jsonl_counts_missing_tokens_with_the_named_tokenizer():
    trace = load_trace(str(FIXTURES / "generic_trace.jsonl"))
    assert trace.tokenizer == "smollm2" and len(trace) == 4
    g0, g1, g2, g3 = trace.records
    assert g0.prompt_tokens > 10 and 5 <= g0.output_tokens <= 12  # counted: chat template + answer
    assert (g1.prompt_tokens, g1.output_tokens, g1.system_prompt_id, g1.depth) == (120, 33, "sys-a", 2)
    assert g2.output_tokens == 20 and g2.generator == "smollm2" and g2.arrival_s == 1.25
    assert g3.prompt_tokens == 7 and g3.output_tokens > 3
    assert g0.temperature == 0.7 and g0.type == "chat"


def test_malformed_file_names_the_line(tmp_path):
    with pytest.raises(TraceError, match=r"malformed_trace.jsonl:3: 'output_tokens'"):
        load_trace(str(FIXTURES / "malformed_trace.jsonl"))
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"prompt_tokens": 3, "output_tokens": 4}\nnot json\n')
    with pytest.raises(TraceError, match=r"t.jsonl:2: not valid JSON"):
        load_trace(str(bad))
    bad.write_text('{"prompt_tokens": 3}\n')
    with pytest.raises(TraceError, match=r":1: needs 'output' or 'output_tokens'"):
        load_trace(str(bad))


def test_unknown_trace_and_missing_file():
    with pytest.raises(TraceError, match="unknown trace 'nosuch'"):
        load_trace("nosuch")
    with pytest.raises(TraceError, match="not found"):
        load_trace("/nonexistent/trace.jsonl")
    with pytest.raises(TraceError, match="unknown AlpacaEval generator"):
        load_trace("alpaca-eval:gpt-9", data_dir=FIXTURES)


def test_round_trip_through_jsonl(tmp_path):
    trace = load_trace(str(FIXTURES / "generic_trace.jsonl"))
    write_jsonl_trace(trace, tmp_path / "out.jsonl")
    again = load_trace(str(tmp_path / "out.jsonl"))
    assert [(r.request_id, r.prompt_tokens, r.output_tokens) for r in again] == [
        (r.request_id, r.prompt_tokens, r.output_tokens) for r in trace
    ]


def _records(prompts):
    return [TraceRecord(f"r{i}", p, 10, 5) for i, p in enumerate(prompts)]


def test_splits_are_deterministic_and_never_share_a_prompt():
    prompts = [f"question {i % 300}" for i in range(1000)]  # duplicated prompts
    trace = Trace("t", _records(prompts), "smollm2")
    a, b = split_trace(trace), split_trace(trace)
    assert [[r.request_id for r in s] for s in a] == [[r.request_id for r in s] for s in b]
    seen = [{r.prompt for r in s} for s in a]
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    assert sum(len(s) for s in a) == 1000
    assert 0.7 < len(a.train) / 1000 < 0.9


def test_split_fraction_validation():
    with pytest.raises(TraceError):
        split_trace(Trace("t", [], None), (0.5, 0.5, 0.5))


def test_prompt_only_set_refuses_length_use():
    t = Trace("p", [TraceRecord("a", "q", 5, None)], "smollm2")
    with pytest.raises(TraceError, match="prompt-only"):
        t.output_lengths()


@needs_shared
@pytest.mark.parametrize(
    "name,n,tokenizer",
    [("nq", 3610, "smollm2"), ("azure-conv", 19366, "source"), ("azure-code", 8819, "source"),
     ("alpaca", 805 + 999, "smollm2"), ("alpaca-eval:llama-2-7b-chat-hf", 805, "smollm2")],
)
def test_named_traces_load(name, n, tokenizer):
    trace = load_trace(name)
    assert len(trace) == n and trace.tokenizer == tokenizer
    lengths = trace.output_lengths()
    assert min(lengths) >= 0 and max(lengths) > 100
    assert all(r.prompt_tokens > 0 for r in trace)


@needs_shared
def test_nq_keeps_censoring_and_azure_keeps_arrivals():
    nq = load_trace("nq")
    assert sum(not r.finished for r in nq) == 429  # the 512-token cap (datasets README)
    conv = load_trace("azure-conv", limit=100)
    arrivals = [r.arrival_s for r in conv]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals[-1] > 0


def test_sharegpt_first_turns_and_joined_specs():
    trace = load_trace("sharegpt", limit=50)
    assert len(trace) == 50 and all(r.prompt and r.output_tokens > 0 for r in trace)
    # described as odma-serve describes a chat's first turn: depth 0, no type, nothing earlier
    assert all(r.depth == 0 and r.type is None and r.prior_output_tokens is None for r in trace)
    joined = load_trace(f"sharegpt,{FIXTURES / 'generic_trace.jsonl'}", limit=5)
    assert len(joined) == 9 and len({r.request_id for r in joined}) == 9
    capped = load_trace("nq,sharegpt", limit=5)  # NQ's answers were cut at 512 tokens, ShareGPT's were not
    assert capped.meta["parts"]["nq"] == {"length_cap": 512} and "length_cap" not in capped.meta
    assert load_trace("nq,nq", limit=5).meta["length_cap"] == 512  # every part capped: the cap holds


def test_sharegpt_chat_turns_carry_their_history():
    """Every turn is a request: depth counts the earlier replies, prior_output_tokens is their mean length,
    prompt_tokens grows with the history, a conversation's turns never straddle two splits, and no two chats
    open with the same prompt (re-shares of one chat would leak between splits)."""
    trace = load_trace("sharegpt-chat", limit=200)
    by_part: dict[str, list[TraceRecord]] = {}  # a stored part of a chat: "sharegpt-<root>_<n>-<depth>"
    for r in trace:
        by_part.setdefault(r.request_id.rsplit("-", 1)[0], []).append(r)
        assert r.request_id.startswith(r.conversation_id + "_")  # the parts of one chat share its root id
    multi = [turns for turns in by_part.values() if len(turns) >= 3]
    assert multi, "the first 200 turns hold conversations of 3+ turns"
    for turns in multi:
        assert [r.depth for r in turns] == list(range(len(turns)))
        assert turns[0].prior_output_tokens is None
        for k in range(1, len(turns)):
            assert turns[k].prior_output_tokens == pytest.approx(
                sum(r.output_tokens for r in turns[:k]) / k)
            assert turns[k].last_output_tokens == turns[k - 1].output_tokens
            # the history holds every earlier reply, so the templated prompt is longer than all of them
            assert turns[k].prompt_tokens > turns[k - 1].prompt_tokens + turns[k - 1].output_tokens
    openings = [normalized_prompt(turns[0].prompt) for turns in by_part.values()
                if turns[0].request_id.endswith("_0-0")]
    assert len(openings) == len(set(openings))
    home = {}
    for name, part in zip(("train", "val", "test"), split_trace(trace)):
        for r in part:
            assert home.setdefault(r.conversation_id, name) == name


def test_conversation_fields_round_trip_and_validate(tmp_path):
    rec = TraceRecord("c1-1", "and then?", 80, 12, depth=1, prior_output_tokens=40.0, last_output_tokens=40,
                      conversation_id="c1")
    write_jsonl_trace([rec], tmp_path / "t.jsonl")
    back = load_trace(str(tmp_path / "t.jsonl")).records[0]
    assert (back.depth, back.prior_output_tokens, back.last_output_tokens, back.conversation_id) == (1, 40.0, 40, "c1")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "prompt_tokens": 3, "output_tokens": 2, "prior_output_tokens": -1}))
    with pytest.raises(TraceError, match="prior_output_tokens"):
        load_trace(str(bad))


def test_smollm2_answers_come_from_the_data_dir_where_the_repository_has_none(tmp_path, monkeypatch):
    """An installed wheel ships no datasets/: the named trace is then read from the data dir, and its absence
    there is an error naming the path and the setting."""
    import odma.trace_sources

    monkeypatch.setattr(odma.trace_sources, "SMOLLM2_ANSWERS", tmp_path / "site-packages" / "answers.jsonl")
    with pytest.raises(TraceError, match=r"smollm2_answers/answers.jsonl.*ODMA_DATA_DIR"):
        load_trace("smollm2-answers", data_dir=tmp_path)
    (tmp_path / "smollm2_answers").mkdir()
    (tmp_path / "smollm2_answers" / "answers.jsonl").write_text(
        json.dumps({"id": "a#s1", "prompt": "Say hi", "prompt_tokens": 3, "output_tokens": 7, "finished": True}) + "\n")
    trace = load_trace("smollm2-answers", data_dir=tmp_path)
    assert trace.name == "smollm2-answers" and trace.output_lengths() == [7] and trace.meta["length_cap"] == 512


def test_the_data_dir_of_an_installed_package_is_found_from_the_working_directory(tmp_path, monkeypatch):
    """A wheel installed into a venv has no ../shared beside its package: the working directory's is used."""
    import odma.config as config

    monkeypatch.delenv("ODMA_DATA_DIR", raising=False)
    monkeypatch.setattr(config, "REPO_ROOT", tmp_path / "venv" / "lib" / "site-packages")
    project = tmp_path / "project"
    (tmp_path / "shared" / "datasets").mkdir(parents=True)
    project.mkdir()
    monkeypatch.chdir(project)
    assert config.default_data_dir() == project.parent / "shared" / "datasets"
    monkeypatch.setenv("ODMA_DATA_DIR", str(tmp_path / "elsewhere"))
    assert config.default_data_dir() == tmp_path / "elsewhere"
