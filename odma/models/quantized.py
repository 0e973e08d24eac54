"""Linear layers and token embeddings on GGUF-quantized weights (`--weights native`), kept in their blocks.

A QuantLinear holds one or more parts, each a block of output rows in one GGUF block type packed for the CPU
backend's quantized kernel (backends/cpu_quant.py): a fused layer (q/k/v, gate/up) whose tensors share a type is
one part, one kernel call; parts of different types (a Q4_K_M file's Q6_K v beside Q4_K q and k) write their own
columns of one output. A QuantEmbedding looks rows up in the raw blocks and dequantizes only those (gguf-py's
dequantization: the values odma's fp32 cache holds). Neither keeps a float copy of its weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from backends.cpu_quant import QuantKernel


@dataclass(frozen=True, slots=True)
class QuantPart:
    packed: torch.Tensor  # uint8, the kernel's panels
    ggml_id: int
    rows: int  # output features of this part


class QuantLinear(nn.Module):
    """y = x @ W.T + b, W in quantized parts (fp32 x and y; other dtypes are cast to fp32 and back)."""

    def __init__(self, kernel: QuantKernel, in_features: int, parts: list[QuantPart],
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.kernel, self.parts, self.in_features = kernel, parts, in_features
        self.out_features = sum(p.rows for p in parts)
        # a plain attribute, like the parts: to_empty() and .to() leave them alone (they live on the CPU)
        self.bias_f32 = None if bias is None else bias.detach().float().contiguous()

    @property
    def nbytes(self) -> int:
        return sum(p.packed.numel() for p in self.parts) + (0 if self.bias_f32 is None else self.bias_f32.numel() * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, shape = x.dtype, x.shape
        rows = x.reshape(-1, self.in_features).float()
        if len(self.parts) == 1:
            p = self.parts[0]
            y = self.kernel(rows, p.packed, p.ggml_id, p.rows, self.bias_f32)
        else:
            y = torch.empty((rows.shape[0], self.out_features), dtype=torch.float32)
            col = 0
            for p in self.parts:
                bias = None if self.bias_f32 is None else self.bias_f32[col:]
                self.kernel(rows, p.packed, p.ggml_id, p.rows, bias, out=y[:, col:])
                col += p.rows
        return y.view(*shape[:-1], self.out_features).to(dtype)

    def extra_repr(self) -> str:
        from backends.cpu_quant import block_type

        kinds = "+".join(f"{block_type(p.ggml_id).name}[{p.rows}]" for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, {kinds}, {self.nbytes / 1e6:.1f} MB"


class QuantEmbedding(nn.Module):
    """Token embeddings looked up in a GGUF tensor's raw blocks (uint8 [vocab, row bytes])."""

    def __init__(self, raw: np.ndarray, ggml_id: int, dim: int) -> None:
        super().__init__()
        self.raw = torch.from_numpy(np.ascontiguousarray(raw))  # a plain attribute (see QuantLinear)
        self.ggml_id, self.embedding_dim = ggml_id, dim

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from gguf import GGMLQuantizationType, dequantize

        rows = self.raw[ids.reshape(-1).cpu()]
        if self.ggml_id == GGMLQuantizationType.Q8_0:  # the usual embedding type: gguf-py's arithmetic, in torch
            out = _q8_0_rows(rows).reshape(-1, self.embedding_dim)
        else:
            out = torch.from_numpy(dequantize(rows.numpy(), GGMLQuantizationType(self.ggml_id)))
        return out.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.raw.shape[0]}, {self.embedding_dim}, ggml type {self.ggml_id}, {self.nbytes / 1e6:.1f} MB"


Q8_0_BLOCK = 34  # bytes: an fp16 scale, then 32 int8


def _q8_0_rows(rows: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks (uint8 [n, row bytes]) to fp32 as gguf-py computes them (q * d in fp32: the same bits), without its
    per-call numpy splitting, which cost a decode step of one request 0.16 ms."""
    blocks = rows.reshape(-1, Q8_0_BLOCK)
    scale = blocks[:, :2].contiguous().view(torch.float16).float()
    return blocks[:, 2:].contiguous().view(torch.int8).float() * scale
