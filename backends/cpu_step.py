"""The CPU backend's decode-step kernel (csrc/decode_step.c): a model's decoder layers for a step in which every
request feeds one token, in one ctypes call, over fp32 activations and the requests' contiguous KV blocks.

Why: at one stream SmolLM2-135M's decode step spent about as long in Python and small torch ops around its 30
layers as in its GEMMs (csrc/decode_step.c's header). The caller describes each layer once (`LayerSpec`: norm
weights and the packed GEMMs of the backend's fp32 and quantized kernels, by their entry points), `prepare` turns
that into the C structs, and each step is one call per run of layers.

Built for ODMA_CPU_ISA's instruction set as the GEMMs are (this CPU's, or AVX2 + FMA + F16C with `avx2`: the tiled
prefill attention's two vector paths), OpenMP where the compiler has it; None where it cannot be, and the model keeps
its Python layers.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from backends import ckernels
from backends.cpu_attention import PieceTables, piece_pointers
from backends.errors import BackendError

SOURCE = ckernels.CSRC / "decode_step.c"
_PORTABLE = ("-O3", "-ffast-math", "-fPIC")
_ISA_FLAGS = {"auto": ("-march=native",), "avx2": ("-march=x86-64-v3", "-mtune=native")}
# GemmPart.type of linear.c's fp32 and bf16 panels; otherwise the GGUF block type of quant_linear.c
FP32_PANELS, BF16_PANELS = -1, -2
MODES = ("native", "decode", "python")
_I64, _P = ctypes.c_int64, ctypes.c_void_p


def step_mode() -> str:
    """ODMA_CPU_STEP: native (default: every step through this kernel where the model allows, a prefill chunk's
    rows too) | decode (steps with prefill rows through the model's own layers) | python (the
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
                ("lens", _P), ("rotary", _P), ("half", _I64), ("piece_start", _P), ("piece_block", _P),
                ("piece_layer_stride", _P), ("piece_half_stride", _P), ("piece_first", _P), ("piece_end", _P),
                ("own_first", _P)]


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
        self._chunk = lib.odma_chunk_attention
        self._chunk.restype = ctypes.c_int
        self._chunk.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64]
        self.tiled_rows = int(lib.odma_prefill_min_rows())  # a chunk of at least this many rows attends tiled

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
                 count: int | None = None, half: bool = False, pieces: PieceTables | None = None) -> None:
        """Layers [first, first + count) over x [B, hidden] (fp32, contiguous) in place. Request b's block is at
        address blocks[b] (int64 tensors: decode_attention's layout, fp16 K/V where `half`, else fp32); lens[b] its
        context with this step's token, whose K and V the kernel writes at row lens[b] - 1 (of its block: less the
        rows its pieces hold); rotary: [> max(lens) - 1, head_dim] fp32 (cos | sin). pieces: the rows requests read
        from other blocks (`cpu_attention.PieceTables`; decode rows only)."""
        count = len(layers) - first if count is None else count
        b = x.shape[0]
        if not (0 <= first and first + count <= len(layers)) or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"layers [{first}, {first + count}) of {len(layers)} over x {tuple(x.shape)} {x.dtype}")
        if any(t.shape != (b,) or t.dtype != torch.int64 for t in (blocks, layer_stride, half_stride, lens)):
            raise ValueError("blocks, strides and lens must be int64 [batch]")
        if rotary.dtype != torch.float32 or not rotary.is_contiguous() or rotary.shape[0] < int(lens.max()):
            raise ValueError(f"rotary table {tuple(rotary.shape)} does not cover position {int(lens.max()) - 1}")
        step = _Step(b, torch.get_num_threads(), blocks.data_ptr(), layer_stride.data_ptr(), half_stride.data_ptr(),
                     lens.data_ptr(), rotary.data_ptr(), int(half), *piece_pointers(pieces))
        code = self._fn(ctypes.byref(layers.shape), layers.layers, first, count, ctypes.byref(step), x.data_ptr())
        if code:
            raise RuntimeError(f"decode-step kernel failed (code {code}) on {b} requests, layers "
                               f"[{first}, {first + count})")


    def chunk_attention(self, kv: torch.Tensor, q: torch.Tensor, start: int, min_rows: int | None = None,
                        threads: int = 1) -> torch.Tensor:
        """The attention the step computes for one prefill chunk (for tests and measurements): kv [2, capacity,
        kv_heads, head_dim] (one layer's K then V, fp32 or fp16, rows [0, start + rows) written), q [rows, heads,
        head_dim] fp32 for positions start .. start + rows - 1; returns [rows, heads, head_dim], causal, query head h
        reading KV head h // (heads // kv_heads). min_rows: chunks of at least this many rows run tiled, others row by
        row (default: the step's threshold)."""
        rows, heads, dim = q.shape
        if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[3] != dim or kv.dtype not in (torch.float32, torch.float16):
            raise ValueError(f"kv {tuple(kv.shape)} {kv.dtype}: expected [2, capacity, kv_heads, {dim}] fp32 or fp16")
        if not kv[0].is_contiguous() or kv.stride(0) < kv[0].numel() or start + rows > kv.shape[1]:
            raise ValueError(f"kv {tuple(kv.shape)}: rows must be contiguous and hold positions up to {start + rows}")
        if q.dtype != torch.float32 or heads % kv.shape[2] or start < 0:
            raise ValueError(f"q {tuple(q.shape)} {q.dtype} at {start}: fp32, heads a multiple of the KV heads")
        q = q.contiguous()
        out = torch.empty_like(q)
        code = self._chunk(kv.data_ptr(), kv.stride(0), start, rows, heads, kv.shape[2], dim, q.data_ptr(),
                           out.data_ptr(), int(kv.dtype == torch.float16),
                           self.tiled_rows if min_rows is None else min_rows, threads)
        if code:
            raise RuntimeError(f"chunk attention failed (code {code})")
        return out


def _check_vector(t: torch.Tensor, n: int, dtype: torch.dtype, what: str) -> None:
    """t: a contiguous vector of `dtype` on the CPU, at least n long (a bias part may run on into later parts')."""
    if t.dtype != dtype or t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous() or t.numel() < n:
        raise ValueError(f"{what}: expected a contiguous {dtype} vector of {n} on the CPU, got {tuple(t.shape)} "
                         f"{t.dtype} on {t.device}")


_loaders: dict[str, ckernels.Loader[DecodeStepKernel]] = {}


def load(isa: str | None = None) -> DecodeStepKernel | None:
    """The kernel built for `isa` (default: ODMA_CPU_ISA's) on first use, then the same one; None where it cannot be
    built (the model keeps its Python layers). BackendError for an instruction set this CPU cannot run."""
    isa = isa or ckernels.requested_isa()
    if isa not in _loaders:
        if isa not in ckernels.ISAS or not ckernels.isa_runs_here(isa):
            raise BackendError(f"{ckernels.ISA_VARIABLE}={isa}: not an instruction set this CPU runs")
        flags = _PORTABLE + _ISA_FLAGS[isa]
        what = "CPU decode-step kernel" + ("" if isa == "auto" else f" ({isa})")
        _loaders[isa] = ckernels.Loader(
            SOURCE, (flags + ("-fopenmp",), flags, _PORTABLE + ("-fopenmp",), _PORTABLE), DecodeStepKernel, what,
            "decode steps run the model's Python layers", link=("-lm",))
    return _loaders[isa]()
