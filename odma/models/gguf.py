"""A GGUF file's tensors served as they are stored (`--weights native`): quantized linear layers run the CPU
backend's kernel on their blocks; float tensors (norms, biases, F32/F16 matrices) are read as floats.

Names and row order follow transformers' GGUF loader, so the model computes what the fp32 cache odma converts
the same file to computes: llama.cpp stores q and k rows permuted for its rotary layout (the `reverse_permute`
transformers applies), and fused layers concatenate rows in our order (q, k, v; gate, up). Block types the kernel
does not have (Q5_K, IQ*, ...) are dequantized to fp32 for that tensor alone, with a warning.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from odma.errors import ConfigError
from odma.models.config import ModelConfig
from odma.models.llama import CausalLM, Rotary
from odma.models.quantized import QuantEmbedding, QuantLinear, QuantPart

if TYPE_CHECKING:
    from backends.cpu_quant import QuantKernel

log = logging.getLogger(__name__)
FLOAT_TYPES = (0, 1, 30)  # ggml F32, F16, BF16


def quantized_types(path: Path) -> set[str]:
    """The block type names of the file's matrices (F32/F16/BF16 excluded): empty for a float GGUF."""
    from gguf import GGMLQuantizationType

    return {GGMLQuantizationType(t.ggml_id).name for t in _Tensors(path).by_name.values()
            if len(t.shape) == 2 and t.ggml_id not in FLOAT_TYPES}


@dataclass(frozen=True, slots=True)
class _Tensor:
    ggml_id: int
    shape: tuple[int, ...]  # GGUF's order: the row length (contiguous) first
    raw: np.ndarray  # uint8 [rows, row bytes], a view of the mapped file


# GGUF metadata value types → bytes (8: string, 9: array are read apart)
_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class _Tensors:
    """The file's tensor table, read straight from its header: gguf-py's reader also decodes every metadata value
    (SmolLM2's 49,152 tokenizer strings: 3.6 s a time), which loading weights does not need."""

    def __init__(self, path: Path) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        buf, pos = self.data, 0

        def take(fmt: str):
            nonlocal pos
            value = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize("<" + fmt)
            return value[0]

        def text() -> str:
            nonlocal pos
            n = take("Q")
            pos += n
            return bytes(buf[pos - n:pos]).decode("utf-8", "replace")

        def skip(kind: int) -> None:
            nonlocal pos
            if kind == 8:
                n = take("Q")  # not `pos += take(...)`: that adds to the position read before take moved it
                pos += n
            elif kind == 9:
                item, count = take("I"), take("Q")
                if item in _VALUE_BYTES:
                    pos += count * _VALUE_BYTES[item]
                else:
                    for _ in range(count):
                        skip(item)
            else:
                pos += _VALUE_BYTES[kind]

        if bytes(buf[:4]) != b"GGUF":
            raise ConfigError(f"{path} is not a GGUF file")
        pos = 4
        take("I")  # version
        n_tensors, n_kv = take("Q"), take("Q")
        alignment = 32
        for _ in range(n_kv):
            key, kind = text(), take("I")
            if key == "general.alignment" and kind == 4:
                alignment = take("I")
            else:
                skip(kind)
        infos = []
        for _ in range(n_tensors):
            name, dims = text(), take("I")
            shape = tuple(take("Q") for _ in range(dims))
            infos.append((name, shape, take("I"), take("Q")))
        start = -(-pos // alignment) * alignment
        self.by_name: dict[str, _Tensor] = {}
        for name, shape, ggml_id, offset in infos:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_id)]
            row_bytes = shape[0] // block * block_bytes
            rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
            at = start + offset
            raw = self.data[at:at + rows * row_bytes].reshape(rows, row_bytes)
            self.by_name[name] = _Tensor(ggml_id, shape, raw)

    def has(self, name: str) -> bool:
        return name in self.by_name

    def get(self, name: str) -> _Tensor:
        try:
            return self.by_name[name]
        except KeyError:
            raise ConfigError(f"GGUF file has no tensor {name!r}") from None

    def floats(self, name: str) -> torch.Tensor:
        """A tensor as fp32 (any type: float ones converted, quantized ones dequantized); a matrix as [rows, cols]."""
        from gguf import GGMLQuantizationType, dequantize

        t = self.get(name)
        out = np.array(dequantize(np.array(t.raw), GGMLQuantizationType(t.ggml_id)), dtype=np.float32)
        return torch.from_numpy(out.reshape(t.raw.shape[0], -1) if len(t.shape) == 2 else out.reshape(-1))


def _unpermute_rows(n_rows: int, heads: int) -> np.ndarray:
    """The row order transformers' reverse_permute gives q (heads = attention heads) or k (KV heads)."""
    return np.arange(n_rows).reshape(heads, n_rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def load_native_model(path: Path, config: ModelConfig, kernel: QuantKernel) -> CausalLM:
    """Our layers for `config` with the GGUF file's weights: quantized matrices stay quantized."""
    from backends.cpu_quant import BLOCK_TYPES

    if config.model_type not in ("llama", "qwen2"):
        raise ConfigError(f"native GGUF weights: model_type {config.model_type!r} is not supported")
    tensors = _Tensors(path)
    c = config

    def matrix_rows(name: str, heads: int | None = None):
        """(ggml id, raw rows or fp32 rows) of one matrix, rows in transformers' order."""
        from gguf import GGMLQuantizationType

        t = tensors.get(name)
        gid = t.ggml_id
        rows = t.raw if gid in BLOCK_TYPES else tensors.floats(name).numpy()
        if gid not in BLOCK_TYPES and gid not in FLOAT_TYPES:
            log.warning("%s is %s, which the quantized kernel does not read: dequantized to fp32", name,
                        GGMLQuantizationType(gid).name)
        if heads is not None and c.model_type == "llama":
            rows = rows[_unpermute_rows(rows.shape[0], heads)]
        return (gid if gid in BLOCK_TYPES else 0), rows

    def linear(names: list[tuple[str, int | None]], in_features: int, bias_names: list[str] | None = None) -> nn.Module:
        """One layer from GGUF matrices stacked by rows: quantized parts (runs of one block type), or, when any
        matrix is a float one, a plain fp32 nn.Linear (the fp32 kernel or oneDNN packs it later)."""
        mats = [matrix_rows(n, h) for n, h in names]
        bias = torch.cat([tensors.floats(b) for b in bias_names]) if bias_names else None
        if any(gid == 0 for gid, _ in mats):
            weight = torch.cat([torch.from_numpy(r) if gid == 0 else _dequantized(gid, r) for gid, r in mats])
            layer = nn.Linear(in_features, weight.shape[0], bias=bias is not None, device="meta")
            layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
            if bias is not None:
                layer.bias = nn.Parameter(bias, requires_grad=False)
            return layer
        groups: list[tuple[int, list[np.ndarray]]] = []  # runs of one block type: one part each
        for gid, rows in mats:
            if groups and groups[-1][0] == gid:
                groups[-1][1].append(rows)
            else:
                groups.append((gid, [rows]))
        parts = [QuantPart(kernel.pack(gid, np.concatenate(rs), in_features), gid, sum(r.shape[0] for r in rs))
                 for gid, rs in groups]
        return QuantLinear(kernel, in_features, parts, bias)

    with torch.device("meta"):
        model = CausalLM(config)
    biases = c.qkv_bias
    for i, layer in enumerate(model.model.layers):
        p = f"blk.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = linear([(p + "attn_q.weight", c.num_heads), (p + "attn_k.weight", c.num_kv_heads),
                                (p + "attn_v.weight", None)], c.hidden_size,
                               [p + f"attn_{x}.bias" for x in "qkv"] if biases else None)
        attn.o_proj = linear([(p + "attn_output.weight", None)], c.num_heads * c.head_dim,
                             [p + "attn_output.bias"] if c.o_bias else None)
        mlp.gate_up_proj = linear([(p + "ffn_gate.weight", None), (p + "ffn_up.weight", None)], c.hidden_size)
        mlp.down_proj = linear([(p + "ffn_down.weight", None)], c.intermediate_size)
        layer.input_layernorm.weight = nn.Parameter(tensors.floats(p + "attn_norm.weight"), requires_grad=False)
        layer.post_attention_layernorm.weight = nn.Parameter(tensors.floats(p + "ffn_norm.weight"), requires_grad=False)
    model.model.norm.weight = nn.Parameter(tensors.floats("output_norm.weight"), requires_grad=False)
    embed = tensors.get("token_embd.weight")
    embed_id = embed.ggml_id
    head = "output.weight" if tensors.has("output.weight") else "token_embd.weight"  # absent: tied to the embeddings
    if embed_id in FLOAT_TYPES:
        model.model.embed_tokens = nn.Embedding.from_pretrained(tensors.floats("token_embd.weight"), freeze=True)
    else:
        # a copy of the blocks: the file is unmapped once loading ends
        model.model.embed_tokens = QuantEmbedding(np.array(embed.raw), embed_id, c.hidden_size)
    if head == "token_embd.weight" and embed_id in FLOAT_TYPES:  # tied, as the dense loader ties them
        model.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device="meta")
        model.lm_head.weight = model.model.embed_tokens.weight
    else:
        model.lm_head = linear([(head, None)], c.hidden_size)
    model.rotary.inv_freq = Rotary(c.head_dim, c.rope_theta).inv_freq
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ConfigError(f"GGUF file left {len(left)} tensors unset, e.g. {left[:3]}")
    return model.eval()


def _dequantized(gid: int, rows: np.ndarray) -> torch.Tensor:
    from gguf import GGMLQuantizationType, dequantize

    return torch.from_numpy(np.array(dequantize(rows, GGMLQuantizationType(gid)), dtype=np.float32))


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy as stored: quantized blocks and float parameters (the packed copies the
    fp32 / bf16 GEMMs keep beside dense weights come on top: pack_linears)."""
    total = sum(m.nbytes for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding)))
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total
