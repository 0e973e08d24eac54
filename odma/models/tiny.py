"""Tiny randomly initialised Llama / Qwen2 folders (same code paths as the real models; tests use them)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_model(folder: str | Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a random transformers model of the given family (config.json + model.safetensors) to `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kw = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=2, bos_token_id=1, pad_token_id=0,
        tie_word_embeddings=False, rope_theta=10000.0,
    )
    kw.update(overrides)
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw)).eval()
    with torch.no_grad():  # random weights are too flat for greedy decoding to be a sharp test: sharpen them
        if not kw["tie_word_embeddings"]:
            model.lm_head.weight.mul_(4.0)
    folder = Path(folder)
    model.save_pretrained(str(folder))
    return folder
