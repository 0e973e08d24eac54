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


def fill_random_(model: torch.nn.Module, device: str, seed: int = 0) -> None:
    """Materialize a meta-device model's parameters on `device`, in place: norms 1, biases 0, every other weight
    N(0, 0.02) from a generator seeded with `seed` on the device (the weights never exist on the host)."""
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


def random_model(shape: dict, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", seed: int = 0):
    """Our layers for `shape` (ModelConfig fields) with random weights made on `device` itself (a 7B model on a GPU
    in seconds, no checkpoint): normal(0, 0.02) matrices, unit norms. For speed and memory measurements with forced
    lengths (ignore_eos): its tokens mean nothing."""
    from odma.models.config import ModelConfig
    from odma.models.llama import CausalLM, Rotary

    config = ModelConfig(**shape)
    with torch.device("meta"):
        model = CausalLM(config).to(dtype)  # allocated in `dtype` directly (a 7B model never exists in fp32)
    fill_random_(model, device, seed)
    model.rotary.inv_freq = Rotary(config.head_dim, config.rope_theta).inv_freq.to(device)
    return model.eval()


def make_tiny_gguf(path: str | Path, arch: str = "llama", types: dict[str, str] | None = None, seed: int = 0,
                   metadata=None, **overrides) -> Path:
    """A tiny random model as a GGUF file, its matrices in GGUF block types: `types` maps a role ("attn_q",
    "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd", "output"; "output": None
    ties the LM head to the embeddings) to a type name (F32, Q4_0, Q4_1, Q8_0: quantized by gguf-py; Q4_K, Q6_K:
    random blocks with small scales, as gguf-py cannot quantize them). q and k rows are permuted as llama.cpp's
    converter permutes a llama's. `metadata`: called with the GGUFWriter to add keys of its own (a tokenizer). For
    the native-weights tests: the same file read by transformers (dense) and by
    odma's native loader must compute the same thing."""
    import numpy as np
    from gguf import GGMLQuantizationType as G, GGUFWriter, quantize

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
              rope_theta=10000.0, eps=1e-6, qkv_bias=arch == "qwen2")
    kw.update(overrides)
    types = {"token_embd": "Q8_0", "output": "Q8_0", **{r: "Q4_1" for r in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                          "ffn_gate", "ffn_up", "ffn_down")},
             **(types or {})}
    h, inter, heads, kv_heads = kw["hidden_size"], kw["intermediate_size"], kw["num_heads"], kw["num_kv_heads"]
    head_dim = h // heads
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_context_length(512), w.add_block_count(kw["num_layers"]), w.add_embedding_length(h)
    w.add_feed_forward_length(inter), w.add_head_count(heads), w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(kw["rope_theta"]), w.add_layer_norm_rms_eps(kw["eps"]), w.add_vocab_size(kw["vocab_size"])
    w.add_rope_dimension_count(head_dim)
    if metadata is not None:
        metadata(w)

    def permute(m: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf permute for q and k
        return m.reshape(n_head, 2, m.shape[0] // n_head // 2, *m.shape[1:]).swapaxes(1, 2).reshape(m.shape)

    def matrix(name: str, role: str, rows: int, cols: int, scale: float = 0.08, heads_of: int | None = None) -> None:
        kind = types[role]
        m = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if heads_of and arch == "llama":
            m = permute(m, heads_of)
        if kind == "F32":
            w.add_tensor(name, m)
        elif kind in ("Q4_0", "Q4_1", "Q8_0"):
            w.add_tensor(name, quantize(m, G[kind]), raw_dtype=G[kind])
        else:
            w.add_tensor(name, _k_blocks(kind, rows, cols, rng), raw_dtype=G[kind])

    matrix("token_embd.weight", "token_embd", kw["vocab_size"], h, scale=0.5)
    if types["output"] is not None:
        matrix("output.weight", "output", kw["vocab_size"], h, scale=0.3)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
    for i in range(kw["num_layers"]):
        p = f"blk.{i}."
        matrix(p + "attn_q.weight", "attn_q", heads * head_dim, h, heads_of=heads)
        matrix(p + "attn_k.weight", "attn_k", kv_heads * head_dim, h, heads_of=kv_heads)
        matrix(p + "attn_v.weight", "attn_v", kv_heads * head_dim, h)
        matrix(p + "attn_output.weight", "attn_output", h, heads * head_dim)
        matrix(p + "ffn_gate.weight", "ffn_gate", inter, h)
        matrix(p + "ffn_up.weight", "ffn_up", inter, h)
        matrix(p + "ffn_down.weight", "ffn_down", h, inter)
        if kw["qkv_bias"]:
            for x, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                w.add_tensor(p + f"attn_{x}.bias", (0.1 * rng.standard_normal(n * head_dim)).astype(np.float32))
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + f"{norm}.weight", (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _k_blocks(kind: str, rows: int, cols: int, rng):
    """Random Q4_K / Q6_K blocks whose fp16 scales keep the weights around 0.05."""
    import numpy as np

    size = {"Q4_K": 144, "Q6_K": 210}[kind]
    raw = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    half = lambda v: np.full((rows, cols // 256, 1), v, np.float16).view(np.uint8)  # noqa: E731
    if kind == "Q4_K":  # w = d * sc * q - dmin * m, sc and m 6-bit, q 4-bit
        raw[..., 0:2], raw[..., 2:4] = half(0.0004), half(0.0004)
    else:  # w = d * sc * (q - 32), sc int8, q 6-bit
        raw[..., 208:210] = half(0.00002)
    return raw.reshape(rows, -1)
