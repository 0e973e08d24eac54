"""The served model's length probe inside the engine: it reads the states the engine computes (no second prefill),
tags requests after their prefill, refines while they decode, learns online, and can never fail a step."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from odma.engine import SamplingParams
from odma.engine.testing import tiny_engine

FIXTURE = Path(__file__).resolve().parent.parent / "datasets" / "fixtures" / "predictor_tiny.jsonl"
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from odma.models.tiny import make_tiny_model
    from odma.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2").hf
    folder = tmp_path_factory.mktemp("served")
    make_tiny_model(folder, vocab_size=len(tok), tie_word_embeddings=True,
                    eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    tok.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def probe_folder(served, tmp_path_factory):
    """A probe of the tiny model trained on answers whose length follows the prompt (training/probe.py)."""
    from training.pipeline import TrainOptions, train

    rng = random.Random(0)
    rows = []
    for line in FIXTURE.read_text().splitlines():
        r = json.loads(line)
        r["output"] = " ".join(rng.choice(["river", "stone", "light"]) for _ in range(max(2, r.pop("output_tokens") // 8)))
        rows.append(r)
    answers = tmp_path_factory.mktemp("trace") / "answers.jsonl"
    answers.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mp = pytest.MonkeyPatch()
    mp.setenv("ODMA_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    out = tmp_path_factory.mktemp("probe")
    train(TrainOptions(trace=str(answers), out=out, model="probe", served_model=str(served), target=0.1,
                       s3_baseline=False, progress=False, threads=1))
    mp.undo()
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ODMA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


PROMPTS = ["Name three rivers.", "Write a long story about a stone.", "What is two plus two?"]


def test_the_probe_tags_refines_and_learns_without_changing_a_token(served, probe_folder, cache):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = [s.output_ids for s in tiny_engine(served, kv_budget="8MiB", max_tokens_cap=64).generate(PROMPTS, params)]
    engine = tiny_engine(served, kv_budget="8MiB", max_tokens_cap=64, probe=str(probe_folder))
    assert engine.probe is not None and engine.probe_fallback is None
    assert engine.runner.capture_layers == engine.probe.capture_layers
    seqs = engine.generate(PROMPTS, params)
    assert [s.output_ids for s in seqs] == plain  # reading states changes nothing the model computes
    c = engine.probe.counters
    assert c.predicted == len(PROMPTS) and c.failures == 0
    assert c.refined == len(PROMPTS) * (40 // engine.probe.refine_every - (40 % engine.probe.refine_every == 0))
    assert all(s.probe_features is not None and s.growth_hint is not None for s in seqs)
    first = [float(s.probe_features.astype("float32").sum()) for s in seqs]
    assert len(set(first)) == len(PROMPTS)  # one state row per request
    assert all(s.predicted_remaining is not None for s in seqs)
    assert engine.probe.stats()["online"]["completions_seen"] == len(PROMPTS)
    assert c.learned == len(PROMPTS)
    engine.close()
    assert any((cache / "online_probe").rglob("state.npz"))  # the online window persists under the cache dir


def test_the_prompt_end_prediction_matches_the_standalone_probe(served, probe_folder, cache):
    """Same chat-templated prompt: the engine's prediction from the states it captured equals the standalone probe's
    (which runs its own prefill)."""
    from types import SimpleNamespace

    from predictor import load_predictor
    from predictor.probe.hidden import ServedModelStates

    text = "Name three rivers."
    ids = ServedModelStates.load(str(served)).prompt_ids(text)
    engine = tiny_engine(served, kv_budget="8MiB", max_tokens_cap=64, probe=str(probe_folder), probe_online=False)
    seq = engine.add_request(ids, SamplingParams(max_tokens=2, temperature=0), prompt_text=text)
    while not seq.finished:
        engine.step()
    probe = load_predictor(str(probe_folder))
    request = SimpleNamespace(**seq.predictor_fields(engine.tagger.generator))
    (length, _), = probe.predict_features(probe.prompt_states([request]), [request])
    assert seq.predicted_length == pytest.approx(length, rel=1e-3)


def test_a_probe_of_another_model_is_refused_and_serving_goes_on(probe_folder, tmp_path, cache):
    from odma.models.tiny import make_tiny_model
    from odma.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2").hf
    other = tmp_path / "other"
    make_tiny_model(other, seed=5, vocab_size=len(tok), tie_word_embeddings=True)
    tok.save_pretrained(str(other))
    engine = tiny_engine(other, kv_budget="8MiB", max_tokens_cap=64, probe=str(probe_folder))
    assert engine.probe is None and "not on" in engine.probe_fallback
    assert engine.runner.capture_layers == ()
    seq = engine.generate(["hi"], SamplingParams(max_tokens=4, temperature=0))[0]
    assert seq.finish_reason in ("stop", "length")


def test_a_failing_probe_fails_no_step(served, probe_folder, cache, monkeypatch):
    engine = tiny_engine(served, kv_budget="8MiB", max_tokens_cap=64, probe=str(probe_folder), probe_online=False)

    def broken(*_a, **_k):
        raise RuntimeError("probe head exploded")

    monkeypatch.setattr(engine.probe.probe, "predict_features", broken)
    seqs = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))
    assert all(s.finish_reason in ("stop", "length") and not s.error for s in seqs)
    assert engine.probe.counters.failures >= 1 and engine.errors == 0
    engine.pool.check_invariants()


def test_metrics_show_the_probe_or_why_it_was_refused(served, probe_folder, cache, tmp_path):
    import httpx

    from odma.server.testing import tiny_server

    with tiny_server(served, probe=str(probe_folder)) as srv:
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        text = httpx.get(f"{srv.url}/metrics", timeout=30).text
    assert 'odma_probe_info{calibration=' in text and 'source="shipped"' in text
    assert "odma_probe_predictions_total 1.0" in text and "odma_probe_online_samples 1.0" in text
    with tiny_server(served, probe=str(tmp_path / "no-such-probe")) as srv:
        text = httpx.get(f"{srv.url}/metrics", timeout=30).text
    assert 'source="refused"' in text
