"""The CPU backend's GEMM on GGUF-quantized weights (csrc/quant_linear.c), called by ctypes: Q4_0, Q4_1, Q8_0,
Q4_K and Q6_K blocks kept quantized in memory at (about) their file's size, dequantized panel by panel inside the
GEMM (fp32 x, y and bias).

`pack` reads a tensor's raw GGUF blocks (what gguf-py's reader maps: uint8 rows of blocks) and regroups them into
the kernel's column panels (the layout: csrc/quant_linear.c). Built like the fp32 kernel (backends/cpu_linear.py):
for this CPU's AVX-512 or AVX2 + FMA, `ODMA_CPU_ISA=avx2` forcing the AVX2 build; None where neither builds.

Activations: the kernel can quantize x to int8 per row and block of 16 depths and take integer dot products with
the weights' q (AVX512-VNNI, AVX-VNNI, or AVX2's vpmaddubsw): faster, but not the fp32 model's bits.
`ODMA_QUANT_ACTIVATIONS` picks: `auto` (default) int8 up to `INT8_ROWS` rows of the type, `f32` never (every
product in fp32: the dequantized fp32 model's bits), `int8` at every row count; read when the kernel loads (the
kernel's `activations` attribute changes it later).
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from backends import ckernels
from backends.cpu_linear import ISA_NAMES
from backends.errors import BackendError

SOURCE = ckernels.CSRC / "quant_linear.c"
_P, _I = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True, slots=True)
class BlockType:
    """One GGUF block format: its ggml id, depths per block, bytes per block, depths per sub-block (one s, o)."""

    name: str
    ggml_id: int
    block: int
    block_bytes: int
    sub: int
    offset: bool  # w = s * q + o (else s * q)
    nibbles: bool  # 4-bit q, two to a byte (Q6_K: its low 4 bits so, the high 2 apart)


BLOCK_TYPES = {t.ggml_id: t for t in (
    BlockType("Q4_0", 2, 32, 18, 32, False, True),
    BlockType("Q4_1", 3, 32, 20, 32, True, True),
    BlockType("Q8_0", 8, 32, 34, 32, False, False),
    BlockType("Q4_K", 12, 256, 144, 32, True, True),
    BlockType("Q6_K", 14, 256, 210, 16, False, True),
)}


# the kernel's q are unsigned, w = s * (q - centre) (+ o) (csrc/quant_linear.c); `unpack_q` gives Q4_0's nibble,
# Q8_0's and Q6_K's signed q, which `pack` shifts by this much
TO_UNSIGNED = {"Q4_0": 0, "Q4_1": 0, "Q8_0": 128, "Q4_K": 0, "Q6_K": 32}


ACTIVATIONS_VARIABLE = "ODMA_QUANT_ACTIVATIONS"
ACTIVATIONS = ("auto", "f32", "int8")
# `auto`: up to how many rows int8 activations are taken, per type (None: every row count). Measured with
# scripts/gemm_int8_rows.py (SmolLM2's shapes, one thread, Zen 5): int8 faster at every row count tried, 1 to 512
# rows, for every type and both builds (AVX512-VNNI 1.2-2.7x, AVX2 vpmaddubsw 1.4-3.9x; Q4_0 and Q4_1 on AVX-512
# still 1.23x at 2,048 rows), so no type has a limit.
INT8_ROWS: dict[str, int | None] = {"Q4_0": None, "Q4_1": None, "Q8_0": None, "Q4_K": None, "Q6_K": None}
INT8_ISA_NAMES = {0: "none", 1: "avx2_maddubs", 2: "avx_vnni", 3: "avx512_vnni"}


def requested_activations() -> str:
    """ODMA_QUANT_ACTIVATIONS, checked: a typo must not silently change the model's numbers."""
    value = os.environ.get(ACTIVATIONS_VARIABLE, "auto").strip().lower() or "auto"
    if value not in ACTIVATIONS:
        raise BackendError(f"{ACTIVATIONS_VARIABLE}={value!r}: expected one of {', '.join(ACTIVATIONS)}")
    return value


def block_type(ggml_id: int) -> BlockType:
    try:
        return BLOCK_TYPES[int(ggml_id)]
    except KeyError:
        names = ", ".join(t.name for t in BLOCK_TYPES.values())
        raise ValueError(f"ggml type {ggml_id} has no quantized kernel (supported: {names})") from None


def _blocks(t: BlockType, rows: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(rows, dtype=np.uint8).reshape(rows.shape[0], -1, t.block_bytes)


def unpack_q(t: BlockType, rows: np.ndarray) -> np.ndarray:
    """rows: uint8 [N, K / block * block_bytes] → q [N, K]: uint8 for the 4-bit types (Q4_0: the nibble, centred by
    the kernel), int8 for Q8_0 and Q6_K (Q6_K's 6-bit q less 32, as gguf-py dequantizes it)."""
    n, b = rows.shape[0], _blocks(t, rows)
    if t.name in ("Q4_0", "Q4_1"):
        qs = b[..., 2 if t.name == "Q4_0" else 4:]
        return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1)  # element i, then i + 16 of each block
    if t.name == "Q8_0":
        return b[..., 2:].copy().view(np.int8).reshape(n, -1)
    if t.name == "Q4_K":
        qs = b[..., 16:].reshape(n, -1, 4, 32)  # four groups of 32 bytes: sub-blocks 2g (low) and 2g + 1 (high)
        return np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, -1)
    # Q6_K: ql [128], qh [64], scales int8 [16], d fp16
    ql, qh = b[..., :128].reshape(n, -1, 2, 1, 64), b[..., 128:192].reshape(n, -1, 2, 1, 32)
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F  # [n, blocks, 2, 2, 64]
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03  # [n, blocks, 2, 4, 32]
    q = (low.reshape(n, -1, 2, 4, 32) | (high << 4)).astype(np.int8) - np.int8(32)
    return q.reshape(n, -1)


def block_heads(t: BlockType, rows: np.ndarray) -> list[np.ndarray]:
    """A layout block's head, as the kernel reads it, per row: arrays [N, blocks] of fp16 (s and o of Q4_0, Q4_1 and
    Q8_0; d and dmin of Q4_K; d of Q6_K) and [N, blocks, sub-blocks] of bytes (Q4_K's sc then m, 6 bits each; Q6_K's
    signed scales). w = s * q + o with s = d * sc and o = -(dmin * m) for Q4_K, s = d * scale for Q6_K."""
    n, b = rows.shape[0], _blocks(t, rows)
    half = lambda a: a.copy().view(np.float16).reshape(n, -1)  # noqa: E731 - little-endian fp16 pairs
    if t.name in ("Q4_0", "Q8_0"):
        return [half(b[..., 0:2])]
    if t.name == "Q4_1":
        return [half(b[..., 0:2]), half(b[..., 2:4])]
    if t.name == "Q4_K":
        return [half(b[..., 0:2]), half(b[..., 2:4]), *_k_scales(b[..., 4:16])]
    return [half(b[..., 208:210]), b[..., 192:208].copy().view(np.int8)]  # Q6_K


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's twelve bytes of 6-bit scales and mins → (sc, m), eight each per block."""
    shape = packed.shape[:-1]
    p = packed.reshape(*shape, 3, 4)
    d, m, md = p[..., 0, :], p[..., 1, :], p[..., 2, :]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


class QuantKernel:
    """y = x @ W.T + b for fp32 CPU tensors, W a GGUF tensor's quantized blocks packed once by `pack`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.odma_quant_linear
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_P, _I, _I, _P, ctypes.c_int, _I, _I, _P, _P, _I, _I, _I]
        self._dequantize = lib.odma_quant_dequantize
        self._dequantize.restype = ctypes.c_int
        self._dequantize.argtypes = [_P, ctypes.c_int, _I, _I, _P]
        self._panel_bytes = lib.odma_quant_panel_bytes
        self._panel_bytes.restype, self._panel_bytes.argtypes = ctypes.c_int64, [ctypes.c_int, _I]
        self.panel = int(lib.odma_quant_panel())
        self.parallel = bool(lib.odma_quant_openmp())
        self.isa = ISA_NAMES.get(int(lib.odma_quant_isa()), "none")
        if self.isa == "none":
            raise RuntimeError("this CPU has neither AVX-512 nor AVX2 with FMA")
        self.int8 = INT8_ISA_NAMES.get(int(lib.odma_quant_int8_isa()), "none")  # the integer dot product's path
        # the GEMM's int8_rows argument by ggml id (set by `activations`): a C array, which kernels calling the GEMM
        # from C read at each call too
        self._int8_rows = (ctypes.c_int64 * (max(BLOCK_TYPES) + 1))()
        self.activations = requested_activations()

    @property
    def activations(self) -> str:
        """`auto`, `f32` or `int8` (see the module's docstring); settable."""
        return self._activations

    @activations.setter
    def activations(self, value: str) -> None:
        if value not in ACTIVATIONS:
            raise BackendError(f"activations {value!r}: expected one of {', '.join(ACTIVATIONS)}")
        if value == "int8" and self.int8 == "none":
            raise BackendError(f"{ACTIVATIONS_VARIABLE}=int8: this build ({self.isa}) has no integer dot product "
                               "(AVX-512 without VNNI)")
        self._activations = value
        every = 2**62
        for t in BLOCK_TYPES.values():  # int8 up to this many rows
            self._int8_rows[t.ggml_id] = (0 if value == "f32" or self.int8 == "none" else every if value == "int8"
                                          else every if INT8_ROWS[t.name] is None else INT8_ROWS[t.name])

    def int8_rows_address(self, ggml_id: int) -> int:
        """Where the current int8_rows argument for `ggml_id` lives (it follows `activations`), for kernels that call
        the GEMM from C (backends/cpu_step.py)."""
        return ctypes.addressof(self._int8_rows) + int(ggml_id) * ctypes.sizeof(ctypes.c_int64)

    @property
    def address(self) -> int:
        """The GEMM's entry point, for kernels that call it from C (backends/cpu_step.py)."""
        return ctypes.cast(self._fn, ctypes.c_void_p).value

    def serves(self) -> bool:
        """Whether this build runs at torch's thread count (a serial build would leave threads idle)."""
        return self.parallel or torch.get_num_threads() == 1

    def pack(self, ggml_id: int, rows: np.ndarray, k: int) -> torch.Tensor:
        """A tensor's blocks (uint8 [N, K / block * block_bytes], GGUF's row order) → the kernel's panels (uint8)."""
        t = block_type(ggml_id)
        n = rows.shape[0]
        if k % t.block or rows.ndim != 2 or rows.shape[1] != k // t.block * t.block_bytes:
            raise ValueError(f"{t.name}: rows of shape {tuple(rows.shape)} do not hold {k} depths in blocks of "
                             f"{t.block}")
        panels, p, subs, blocks = -(-n // self.panel), self.panel, k // t.sub, k // t.block
        pad = panels * p - n

        def by_panel(a: np.ndarray) -> np.ndarray:  # [N, blocks, ...] → [panels, blocks, ..., P], zero-padded columns
            a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
            a = a.reshape(panels, p, *a.shape[1:])
            return np.ascontiguousarray(np.moveaxis(a, 1, -1))

        q = (unpack_q(t, rows).astype(np.int16) + TO_UNSIGNED[t.name]).astype(np.uint8)  # unsigned: Q8_0 + 128, Q6_K + 32
        q = by_panel(q.reshape(n, subs, t.sub))  # [panels, subs, sub, P]
        if t.nibbles:  # groups of 8 depths: byte b of a column's lane holds depth 8g + b low, 8g + 4 + b high
            lanes = q.reshape(panels, subs, t.sub // 8, 2, 4, p) & 0x0F
            lanes = lanes[:, :, :, 0] | (lanes[:, :, :, 1] << 4)  # [panels, subs, groups, 4, P]
            if t.name == "Q6_K":  # then the high 2 bits of the sub-block's 16: byte b, bits 4g + 2h for depth 8g + 4h + b
                high = (q >> 4).reshape(panels, subs, 2, 2, 4, p)  # [.., g, h, b, P]
                shift = np.array([[0, 2], [4, 6]], dtype=np.uint8).reshape(1, 1, 2, 2, 1, 1)
                high = np.bitwise_or.reduce((high << shift).reshape(panels, subs, 4, 4, p), axis=2)
                lanes = np.concatenate([lanes, high[:, :, None]], axis=2)  # [panels, subs, groups + 1, 4, P]
        else:  # groups of 4 depths, byte b of a column's lane holding depth 4g + b
            lanes = q.reshape(panels, subs, t.sub // 4, 4, p)
        lanes = np.ascontiguousarray(np.swapaxes(lanes, -1, -2))  # [.., P, 4]: one 32-bit lane a column
        parts = [by_panel(h).view(np.uint8).reshape(panels, blocks, -1) for h in block_heads(t, rows)]
        parts.append(lanes.view(np.uint8).reshape(panels, blocks, -1))
        packed = np.ascontiguousarray(np.concatenate(parts, axis=-1)).reshape(-1)
        expected = self._panel_bytes(t.ggml_id, k) * panels
        if packed.size != expected:  # the two sides of the layout disagree: a bug, never a silent misread
            raise RuntimeError(f"{t.name}: packed {packed.size} bytes, the kernel expects {expected}")
        return torch.from_numpy(packed)

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, ggml_id: int, out_features: int,
                 bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] fp32 → [M, out_features]; `out`: write into these columns of a wider fp32 [M, *] instead (a
        fused layer whose parts have different block types)."""
        m, k = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty((m, out_features), dtype=torch.float32) if out is None else out
        if m:
            code = self._fn(x.data_ptr(), m, x.stride(0), packed.data_ptr(), ggml_id, k, out_features,
                            None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0),
                            torch.get_num_threads(), self._int8_rows[ggml_id])
            if code:
                raise RuntimeError(f"quantized linear kernel failed (code {code}) on x {tuple(x.shape)}, "
                                   f"type {ggml_id}")
        return y

    def dequantize(self, packed: torch.Tensor, ggml_id: int, k: int, n: int) -> torch.Tensor:
        """The fp32 rows [n, k] the GEMM multiplies by."""
        out = torch.empty((n, k), dtype=torch.float32)
        code = self._dequantize(packed.data_ptr(), ggml_id, k, n, out.data_ptr())
        if code:
            raise RuntimeError(f"quantized dequantize failed (code {code})")
        return out


# built on first use for ODMA_CPU_ISA's instruction set; None where it cannot be (the model then keeps fp32 weights)
load: ckernels.IsaLoader[QuantKernel] = ckernels.IsaLoader(
    SOURCE, QuantKernel, "CPU quantized-weights kernel", "quantized GGUF weights are dequantized to fp32",
    level=logging.INFO)
