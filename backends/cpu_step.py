"""The CPU backend's decode-step kernel (csrc/decode_step.c): a model's decoder layers for a step in which every
request feeds one token, in one ctypes call, over fp32 activations and the requests' contiguous KV blocks.

Why: at one stream SmolLM2-135M's decode step spent about as long in Python and small torch ops around its 30
layers as in its GEMMs (csrc/decode_step.c's header). The caller describes each layer once (`LayerSpec`: norm
weights and the packed GEMMs of the backend's fp32 and quantized kernels, by their entry points), `prepare` turns
that into the C structs, and each step is one call per run of layers.

Built like the decode-attention kernel (this CPU, OpenMP where the compiler has it); None where it cannot be, and the
model keeps its Python layers.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from backends import ckernels
from backends.errors import BackendError

SOURCE = ckernels.CSRC / "decode_step.c"
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC")
_PORTABLE = ("-O3", "-ffast-math", "-fPIC")
# GemmPart.type of linear.c's fp32 and bf16 panels; otherwise the GGUF block type of quant_linear.c
FP32_PANELS, BF16_PANELS = -1, -2
MODES = ("native", "decode", "python")
_I64, _P = ctypes.c_int64, ctypes.c_void_p


def step_mode() -> str:
    """ODMA_CPU_STEP: native (default: every step through this kernel where the model allows, a prefill chunk's
    rows each as a row of its own) | decode (steps with prefill rows through the model's own layers) | python (the
    model's own layers for every step). The last two for A/B measurements. Checked: a typo must not silently pick
    another path."""
    mode = os.environ.get("ODMA_CPU_STEP", "native").strip().lower() or "native"
    if mode not in MODES:
        raise BackendError(f"ODMA_CPU_STEP={mode!r}: expected one of {', '.join(MODES)}")
    return mode


@dataclass(frozen=True, slots=True)
class GemmPart:
    """One GEMM of a linear layer: `rows` output columns from `col`, through the kernel entry point `fn`."""

    fn: int  # address of odma_linear_f32 (FP32_PANELS), odma_linear_bf16 (BF16_PANELS) or odma_quant_linear
    packed: torch.Tensor
    type: int
    rows: int
    col: int
    bias: torch.Tensor | None  # this part's columns: bf16 for BF16_PANELS, else fp32
    int8_rows: int | None = None  # GGUF blocks: address of the GEMM's current int8_rows argument (QuantKernel's)


@dataclass(frozen=True, slots=True)
class LinearSpec:
    in_features: int
    out_features: int
    parts: tuple[GemmPart, ...]


@dataclass(frozen=True, slots=True)
class LayerSpec:
    attn_norm: torch.Tensor  # fp32 [hidden] (a bf16 model's weights widened: exact)
    mlp_norm: torch.Tensor
    qkv: LinearSpec  # q, k, v columns in that order
    o: LinearSpec
    gate_up: LinearSpec  # gate columns, then up
    down: LinearSpec


@dataclass(frozen=True, slots=True)
class ModelShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    bf16: bool = False  # a bf16 model: activations rounded to bf16 where its torch ops round them


class _Part(ctypes.Structure):
    _fields_ = [("fn", _P), ("packed", _P), ("type", _I64), ("rows", _I64), ("col", _I64), ("bias", _P),
                ("int8_rows", _P)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64), ("intermediate", _I64),
                ("eps", ctypes.c_float), ("bf16", _I64)]


class _Step(ctypes.Structure):
    _fields_ = [("batch", _I64), ("threads", _I64), ("blocks", _P), ("layer_stride", _P), ("half_stride", _P),
                ("lens", _P), ("rotary", _P), ("half", _I64)]


class PreparedLayers:
    """The C structs of a model's layers, and the tensors they point into (kept alive here)."""

    def __init__(self, shape: _Shape, layers: ctypes.Array, specs: tuple[LayerSpec, ...]) -> None:
        self.shape, self.layers, self.specs = shape, layers, specs

    def __len__(self) -> int:
        return len(self.specs)


class DecodeStepKernel:
    """See the module docstring."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.max_parts = int(lib.odma_decode_step_max_parts())

        class _Linear(ctypes.Structure):
            _fields_ = [("in_", _I64), ("out", _I64), ("parts", _I64), ("part", _Part * self.max_parts)]

        class _Layer(ctypes.Structure):
            _fields_ = [("attn_norm", _P), ("mlp_norm", _P), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                        ("down", _Linear)]

        self._linear_t, self._layer_t = _Linear, _Layer
        self._fn = lib.odma_decode_layers
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_P, _P, _I64, _I64, _P, _P]

    def prepare(self, shape: ModelShape, layers: list[LayerSpec]) -> PreparedLayers:
        """The layers as the kernel reads them. ValueError for a layer it cannot run (a tensor not fp32 and
        contiguous, sizes that disagree with `shape`, more parts than the kernel takes)."""
        s = shape
        widths = {"qkv": (s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim), "o": (s.heads * s.head_dim, s.hidden),
                  "gate_up": (s.hidden, 2 * s.intermediate), "down": (s.intermediate, s.hidden)}
        array = (self._layer_t * len(layers))()
        for i, spec in enumerate(layers):
            for norm in (spec.attn_norm, spec.mlp_norm):
                _check_vector(norm, s.hidden, torch.float32, f"layer {i}'s norm")
            array[i].attn_norm, array[i].mlp_norm = spec.attn_norm.data_ptr(), spec.mlp_norm.data_ptr()
            for name, (k, n) in widths.items():
                setattr(array[i], name, self._linear(getattr(spec, name), k, n, f"layer {i}'s {name}"))
        c_shape = _Shape(s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.eps, int(s.bf16))
        return PreparedLayers(c_shape, array, tuple(layers))

    def _linear(self, spec: LinearSpec, k: int, n: int, what: str):
        if (spec.in_features, spec.out_features) != (k, n):
            raise ValueError(f"{what}: {spec.in_features} -> {spec.out_features}, the model's shape says {k} -> {n}")
        if not 1 <= len(spec.parts) <= self.max_parts:
            raise ValueError(f"{what}: {len(spec.parts)} parts, the kernel takes 1 to {self.max_parts}")
        covered = 0
        out = self._linear_t(k, n, len(spec.parts))
        for j, p in enumerate(sorted(spec.parts, key=lambda p: p.col)):
            if p.col != covered or not p.packed.is_contiguous():
                raise ValueError(f"{what}: parts must be contiguous and cover the output columns in order")
            if p.bias is not None:
                _check_vector(p.bias, p.rows, torch.bfloat16 if p.type == BF16_PANELS else torch.float32,
                              f"{what}'s bias")
            if p.type not in (FP32_PANELS, BF16_PANELS) and not p.int8_rows:
                raise ValueError(f"{what}: a part in GGUF blocks needs the address of its int8_rows argument")
            out.part[j] = _Part(p.fn, p.packed.data_ptr(), p.type, p.rows, p.col,
                                None if p.bias is None else p.bias.data_ptr(), p.int8_rows)
            covered += p.rows
        if covered != n:
            raise ValueError(f"{what}: parts cover {covered} of {n} output columns")
        return out

    def __call__(self, layers: PreparedLayers, x: torch.Tensor, blocks: torch.Tensor, layer_stride: torch.Tensor,
                 half_stride: torch.Tensor, lens: torch.Tensor, rotary: torch.Tensor, first: int = 0,
                 count: int | None = None, half: bool = False) -> None:
        """Layers [first, first + count) over x [B, hidden] (fp32, contiguous) in place. Request b's block is at
        address blocks[b] (int64 tensors: decode_attention's layout, fp16 K/V where `half`, else fp32); lens[b] its
        context with this step's token, whose K and V the kernel writes at row lens[b] - 1; rotary: [> max(lens) - 1,
        head_dim] fp32 (cos | sin)."""
        count = len(layers) - first if count is None else count
        b = x.shape[0]
        if not (0 <= first and first + count <= len(layers)) or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"layers [{first}, {first + count}) of {len(layers)} over x {tuple(x.shape)} {x.dtype}")
        if any(t.shape != (b,) or t.dtype != torch.int64 for t in (blocks, layer_stride, half_stride, lens)):
            raise ValueError("blocks, strides and lens must be int64 [batch]")
        if rotary.dtype != torch.float32 or not rotary.is_contiguous() or rotary.shape[0] < int(lens.max()):
            raise ValueError(f"rotary table {tuple(rotary.shape)} does not cover position {int(lens.max()) - 1}")
        step = _Step(b, torch.get_num_threads(), blocks.data_ptr(), layer_stride.data_ptr(), half_stride.data_ptr(),
                     lens.data_ptr(), rotary.data_ptr(), int(half))
        code = self._fn(ctypes.byref(layers.shape), layers.layers, first, count, ctypes.byref(step), x.data_ptr())
        if code:
            raise RuntimeError(f"decode-step kernel failed (code {code}) on {b} requests, layers "
                               f"[{first}, {first + count})")


def _check_vector(t: torch.Tensor, n: int, dtype: torch.dtype, what: str) -> None:
    """t: a contiguous vector of `dtype` on the CPU, at least n long (a bias part may run on into later parts')."""
    if t.dtype != dtype or t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous() or t.numel() < n:
        raise ValueError(f"{what}: expected a contiguous {dtype} vector of {n} on the CPU, got {tuple(t.shape)} "
                         f"{t.dtype} on {t.device}")


# the kernel, built on first use; None where it cannot be (the model keeps its Python layers)
load: ckernels.Loader[DecodeStepKernel] = ckernels.Loader(
    SOURCE, (_FLAGS + ("-fopenmp",), _FLAGS, _PORTABLE + ("-fopenmp",), _PORTABLE), DecodeStepKernel,
    "CPU decode-step kernel", "decode steps run the model's Python layers", link=("-lm",))
