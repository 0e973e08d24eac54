"""`--model random:NAME`: a random model of a known shape made on the device, served with SmolLM2's tokenizer (what
`odma-bench gpu`'s http part serves; no download)."""

from __future__ import annotations

import pytest

from odma.engine import EngineConfig, LLMEngine, SamplingParams
from odma.errors import ConfigError
from odma.models.random_served import make_random_served_model, random_shape
from odma.server.cli import build_parser, config_from_args


def _engine(**config) -> LLMEngine:
    base = dict(model="random:tiny-qwen2", kv_budget="1MiB", length_log=None, predictor="median", threads=1,
                max_tokens_cap=32, default_max_tokens=32)
    return LLMEngine(EngineConfig(**(base | config)))


def test_a_random_model_covers_the_tokenizer_and_greedy_picks_only_text_tokens():
    engine = _engine()
    tok = engine.tokenizer
    assert engine.model.config.vocab_size >= len(tok) > 256  # the tiny shape's own 256 raised to the tokenizer's
    prompt = "How many rivers are there?"  # text prompts are tokenized with SmolLM2's tokenizer
    seqs = engine.generate([prompt, tok.encode(prompt)], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for seq in seqs:
        assert seq.num_generated == 12
        assert all(3 <= t < len(tok) and t not in tok.all_special_ids for t in seq.output_ids)
    assert seqs[0].output_ids == seqs[1].output_ids  # the same prompt, as text or as its ids
    text = tok.decode(seqs[0].output_ids, skip_special_tokens=True)
    assert text.strip()


def test_the_7b_shape_keeps_its_vocabulary_and_only_the_rows_without_text_are_zero(monkeypatch):
    import torch

    shape = random_shape("random:paper-7b")
    assert shape["vocab_size"] == 152064 and shape["num_layers"] == 28
    # the same rule on a small model of the 7B's vocabulary (the 7B itself does not fit a test)
    small = dict(shape, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)
    from odma.models import random_served

    monkeypatch.setitem(random_served.RANDOM_SHAPES, "test-wide", small)
    model, tok = make_random_served_model("random:test-wide", torch.float32, "cpu")
    rows = model.lm_head.weight.abs().sum(dim=1)
    assert model.config.vocab_size == 152064
    assert (rows[len(tok):] == 0).all() and (rows[tok.all_special_ids] == 0).all()
    assert (rows[3:len(tok)] > 0).all()


def test_odma_serve_flags_build_a_random_engine_and_refuse_what_cannot_be():
    config = config_from_args(build_parser().parse_args(["--model", "random:tiny-qwen2", "--length-log", "",
                                                         "--predictor", "median", "--kv-budget", "1MiB"]))
    assert config.model == "random:tiny-qwen2" and config.dtype == "float32"
    with pytest.raises(ConfigError, match="random:paper-7b, random:tiny-qwen2"):
        _engine(model="random:paper-8b")
    with pytest.raises(ConfigError, match="--weights native"):
        _engine(weights="native")
    with pytest.raises(ConfigError, match="one device"):
        _engine(devices=("cpu:0", "cpu:1"))
