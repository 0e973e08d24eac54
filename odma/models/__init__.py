"""Model weights and layers: load a HF causal LM folder and run it over contiguous per-request KV blocks."""

from odma.models.config import ModelConfig
from odma.models.llama import CausalLM
from odma.models.weights import DTYPES, load_model, resolve_model

__all__ = ["DTYPES", "ModelConfig", "CausalLM", "load_model", "resolve_model"]
