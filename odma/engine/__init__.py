"""The serving engine: sequences, scheduler over the contiguous KV pool, model runner, sampling.

The names below are imported when first used, so that a module of the package (the length predictor's wrapper,
which odma's vLLM plugin uses) loads without the engine and its model code.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"EngineConfig": "odma.engine.config", "LLMEngine": "odma.engine.llm_engine",
            "StepOutput": "odma.engine.llm_engine", "SamplingParams": "odma.engine.sampling"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'odma.engine' has no attribute {name!r}")
