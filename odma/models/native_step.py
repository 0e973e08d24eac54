"""A CausalLM's decoder layers handed to the CPU backend's decode-step kernel (backends/cpu_step.py): the 30-odd layers
of a step run in one native call instead of Python around each, a prefill chunk's rows too (their attention tiled).

`NativeLayers.build` describes every layer by what it already holds (norm weights, linear layers packed for the
backend's fp32 or bf16 kernel or kept in GGUF blocks) and returns None, with the reason, where a layer holds anything
else (oneDNN's packed layers, F.linear): the model then keeps its Python layers for every step. A bf16 model's
activations are rounded to bf16 inside the kernel wherever its torch ops round them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from backends.cpu_attention import DecodeBatch
from backends.cpu_step import (BF16_PANELS, FP32_PANELS, GemmPart, LayerSpec, LinearSpec, ModelShape,
                               PreparedLayers, step_mode)
from odma.models.cpu_linear import KernelLinear
from odma.models.quantized import QuantLinear

if TYPE_CHECKING:
    from backends.cpu_step import DecodeStepKernel

log = logging.getLogger(__name__)

# Prefill chunks of any context run here: a chunk's rows attend tiled (csrc/prefill_attend.h), faster than the Python
# layers' SDPA at each length measured. SmolLM2-135M Q4_1 (the default model's file), fp16 KV, chunks of 256, one
# thread, Intel Xeon @ 2.50GHz (AVX-512 + VNNI, no AMX, no AVX512_BF16), shared by other work (load ~20 on 2 cores), so
# prefill tokens per second of CPU time, medians of alternating runs [range], Python layers → this kernel:
# 2,048-token prompts 184.9 [177-205] → 256.3 [217-264] (3 rounds); 256: 242-258 → 305-360 (2 rounds). The attention
# alone (256 rows after 1,792, SmolLM2's heads, CPU time): 15-16 ms tiled, ~34 ms SDPA.
# `ODMA_CPU_STEP=decode|native .venv/bin/python -m odma.bench.cli batched --shape N/1 --batch 1 --repeats 1`, s_pp_cpu.
# Before the tiled kernel (each row over its prefix on its own) the kernel lost past 512 tokens: one Zen 5 core,
# 1,024-token prompts 728-744 → 641-658 tok/s, 2,048 546-549 → 405-421; chunks past 512 then kept the Python layers.


class NativeLayers:
    """The model's layers as the kernel runs them; `run` is the decode step's layer loop."""

    def __init__(self, kernel: DecodeStepKernel, prepared: PreparedLayers) -> None:
        self.kernel, self.prepared = kernel, prepared
        self.prefill = step_mode() == "native"  # steps with prefill rows too (ODMA_CPU_STEP)
        self.dtype = torch.bfloat16 if prepared.shape.bf16 else torch.float32  # the model's activations

    @classmethod
    def build(cls, model: nn.Module, kernel: DecodeStepKernel | None) -> NativeLayers | None:
        """model: a CausalLM (odma/models/llama.py, which holds the result as `native_layers`)."""
        if kernel is None:
            return None
        c = model.config
        bf16 = model.model.norm.weight.dtype == torch.bfloat16
        try:
            specs = []
            for layer in model.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                specs.append(LayerSpec(
                    attn_norm=_norm(layer.input_layernorm.weight),
                    mlp_norm=_norm(layer.post_attention_layernorm.weight),
                    qkv=_linear(attn.qkv_proj), o=_linear(attn.o_proj), gate_up=_linear(mlp.gate_up_proj),
                    down=_linear(mlp.down_proj)))
            shape = ModelShape(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                               c.rms_norm_eps, bf16)
            return cls(kernel, kernel.prepare(shape, specs))
        except ValueError as e:
            log.info("decode steps keep the model's Python layers: %s", e)
            return None

    def takes_prefill(self, seqs) -> bool:
        """Whether a step with prefill rows (`seqs`: SeqSlots) runs here: ODMA_CPU_STEP allows it (any context)."""
        return self.prefill and any(s.q_len > 1 for s in seqs)

    def serves(self, decode: object) -> bool:
        """Whether a step planned as `decode` is one the kernel runs: the CPU's decode attention took every row
        (`DecodeAttention.plan_step` where each request feeds one token, reading pieces or not, `plan_tokens` for
        prefill rows)."""
        return isinstance(decode, DecodeBatch) and decode.rows is None

    def run(self, x: torch.Tensor, decode: DecodeBatch, rotary: torch.Tensor, first: int = 0,
            count: int | None = None) -> torch.Tensor:
        """Layers [first, first + count) of a step where every request (decode.rows is None) feeds one token; x
        [B, hidden] in the model's dtype; returns the layers' output (fp32 x updated in place)."""
        wide = x.float().contiguous()  # the kernel's activations are fp32 (a bf16 model's: bf16 values, exact)
        self.kernel(self.prepared, wide, decode.blocks, decode.layer_stride, decode.half_stride, decode.lens, rotary,
                    first, count, decode.half, decode.pieces)
        return wide.to(self.dtype)


def _norm(weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"norm weights in {weight.dtype}: the kernel takes fp32 and bf16 models")
    return weight.detach().float().contiguous()  # a bf16 weight widened: exact


def _linear(module: nn.Module) -> LinearSpec:
    """The GEMMs of a linear layer packed for the backend's kernels; ValueError for any other."""
    if isinstance(module, QuantLinear):
        parts, col = [], 0
        for p in module.parts:
            bias = None if module.bias_f32 is None else module.bias_f32[col:]
            parts.append(GemmPart(module.kernel.address, p.packed, p.ggml_id, p.rows, col, bias,
                                  module.kernel.int8_rows_address(p.ggml_id)))
            col += p.rows
        return LinearSpec(module.in_features, module.out_features, tuple(parts))
    if isinstance(module, KernelLinear) and module.packed.dtype in (torch.float32, torch.bfloat16):
        dtype = module.packed.dtype
        bias = None if module.bias is None else module.bias.detach().to(dtype).contiguous()
        kind = FP32_PANELS if dtype == torch.float32 else BF16_PANELS
        part = GemmPart(module.kernel.address(dtype), module.packed, kind, module.out_features, 0, bias)
        return LinearSpec(module.in_features, module.out_features, (part,))
    raise ValueError(f"{type(module).__name__} ({getattr(module, 'extra_repr', lambda: '')()}) has no native GEMM")
