"""The serving engine: sequences, scheduler over the contiguous KV pool, model runner, sampling."""

from odma.engine.config import EngineConfig
from odma.engine.llm_engine import LLMEngine, StepOutput
from odma.engine.sampling import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "SamplingParams", "StepOutput"]
