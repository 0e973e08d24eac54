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


# The paper's model, DeepSeek-R1-Distill-Qwen-7B (its config.json): a Qwen2 with GQA 28/4 and head_dim 128
PAPER_7B = dict(
    model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
    num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=131072,
    tie_word_embeddings=False, qkv_bias=True, o_bias=False,
)
# a few-layer model of the same family for CPU dry runs of what runs at PAPER_7B on a GPU
TINY_QWEN2 = dict(PAPER_7B, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, max_position_embeddings=4096)


def random_model(shape: dict, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", seed: int = 0):
    """Our layers for `shape` (ModelConfig fields) with random weights made on `device` itself (a 7B model on a GPU
    in seconds, no checkpoint): normal(0, 0.02) matrices, unit norms. For speed and memory measurements with forced
    lengths (ignore_eos): its tokens mean nothing."""
    from odma.models.config import ModelConfig
    from odma.models.llama import CausalLM, Rotary

    config = ModelConfig(**shape)
    with torch.device("meta"):
        model = CausalLM(config).to(dtype)  # allocated in `dtype` directly (a 7B model never exists in fp32)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.rotary.inv_freq = Rotary(config.head_dim, config.rope_theta).inv_freq.to(device)
    return model.eval()
