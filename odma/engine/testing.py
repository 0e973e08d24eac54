"""Small engines over tiny random models, for tests and examples (no download, seconds to build)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from odma.config import PoolConfig
from odma.engine.config import EngineConfig
from odma.engine.length_predictor import LoadedPredictor
from odma.engine.llm_engine import LLMEngine


class FixedPredictor:
    """Predicts the same L̂ for every request (forces small blocks, hence migrations, in tests)."""

    name = "fixed"

    def __init__(self, length: float, uncertainty: float = 0.0) -> None:
        self.length, self.uncertainty = length, uncertainty

    def predict(self, requests):
        return [(self.length, self.uncertainty) for _ in requests]


def tiny_engine(folder: str | Path, *, predicted: float | None = None, align: int = 16, **overrides) -> LLMEngine:
    """An engine over the tiny model folder; `predicted` fixes L̂ for every request."""
    from odma.models import load_model

    # fp32 KV: the tiny engine's tests compare with transformers' fp32 model and size memory by fp32 rows; the
    # server's fp16 default has tests of its own
    base = EngineConfig(model=str(folder), kv_budget="2MiB", length_log=None, predictor="median", kv_dtype="float32",
                        max_tokens_cap=128, default_max_tokens=16, pool=PoolConfig(align=align))
    config = replace(base, **overrides)
    predictor = LoadedPredictor(FixedPredictor(predicted), "fixed", None) if predicted is not None else None
    from odma.models import DTYPES

    tokenizer = None
    if (Path(folder) / "tokenizer_config.json").exists():  # a tiny model saved beside a real tokenizer
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return LLMEngine(config, model=load_model(folder, dtype=DTYPES[config.dtype]), tokenizer=tokenizer,
                     predictor=predictor)
