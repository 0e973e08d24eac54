"""The CPU backend's GEMM over column-panel packed weights (csrc/linear.c), called by ctypes: fp32 and bf16.

Why: a decode step reads every weight once for a few rows; oneDNN's kernels on SmolLM2's shapes wait for the
weight stream and then compute, this one overlaps the two (the measurements: csrc/linear.c and
docs/BENCHMARKS.md, "CPU linear layers"). It is built for this CPU's AVX-512 or AVX2 + FMA (`ODMA_CPU_ISA=avx2`
forces the AVX2 build: backends/ckernels.py); bf16 runs on AVX512_BF16's dot products where the CPU has them,
widened to fp32 in registers elsewhere. Without either ISA `load()` returns None and the model keeps oneDNN. With
OpenMP in the build it splits the panels over torch's threads; without, it is used only where torch runs one
thread (`serves()`).
"""

from __future__ import annotations

import ctypes
import logging

import torch

from backends import ckernels

SOURCE = ckernels.CSRC / "linear.c"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGS = [_P, _I, _I, _P, _I, _I, _P, _P, _I, _I]
ISA_NAMES = {512: "avx512", 2: "avx2"}


class LinearKernel:
    """y = x @ W.T + b for CPU tensors of one of `dtypes`, W packed once by `pack`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {torch.float32: lib.odma_linear_f32, torch.bfloat16: lib.odma_linear_bf16}
        for fn in self._fns.values():
            fn.restype, fn.argtypes = ctypes.c_int, _ARGS
        self.panel = int(lib.odma_linear_panel())
        self.parallel = bool(lib.odma_linear_openmp())
        self.isa = ISA_NAMES.get(int(lib.odma_linear_isa()), "none")  # avx512 | avx2: which path this build runs
        self.bf16 = {1: "avx512_bf16", 2: "widened"}.get(int(lib.odma_linear_bf16_mode()), "none")
        # a build without AVX-512 or AVX2 + FMA answers -1: refuse it here, not on the first step, in words (it is
        # built with -march=native, so it lacks them exactly where this CPU does)
        self.dtypes = tuple(d for d in self._fns if self._answers(d))
        if torch.float32 not in self.dtypes:
            raise RuntimeError("this CPU has neither AVX-512 nor AVX2 with FMA")

    def _answers(self, dtype: torch.dtype) -> bool:
        """Whether this build multiplies in `dtype` on this CPU (whatever torch's thread count: `serves` says that)."""
        x, w = torch.ones(1, 2, dtype=dtype), torch.full((1, 2), 2.0, dtype=dtype)
        try:
            return torch.equal(self(x, self.pack(w), None, 1), torch.full((1, 1), 4.0, dtype=dtype))
        except RuntimeError:  # code -1: no AVX-512 (for bf16: no AVX512_BF16)
            return False

    def address(self, dtype: torch.dtype) -> int:
        """The entry point for weights of `dtype`, for kernels that call it from C (backends/cpu_step.py)."""
        return ctypes.cast(self._fns[dtype], ctypes.c_void_p).value

    def serves(self, weight: torch.Tensor) -> bool:
        """Whether this build multiplies by `weight` (its dtype on this CPU; bf16 needs an even K) at torch's thread
        count (a serial build would leave threads idle)."""
        dtype_ok = weight.dtype in self.dtypes and (weight.dtype == torch.float32 or weight.shape[1] % 2 == 0)
        return dtype_ok and (self.parallel or torch.get_num_threads() == 1)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """W [N, K] → panels of `panel` columns of y, zero-padded: fp32 [P, K, panel] (k-major); bf16
        [P, K/2, panel, 2] (k in pairs, as vdpbf16ps reads them). A packed weight serves the build that packed it
        (the AVX-512 and AVX2 builds have different panel widths)."""
        n, k = weight.shape
        panels = -(-n // self.panel)
        padded = torch.zeros(panels * self.panel, k, dtype=weight.dtype)
        padded[:n] = weight.detach()
        if weight.dtype == torch.bfloat16:
            return padded.view(panels, self.panel, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        return padded.view(panels, self.panel, k).transpose(1, 2).contiguous()

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int) -> torch.Tensor:
        """x [..., K] on the CPU, in packed's dtype; returns [..., out_features]. Lean: it runs ~150 times per step."""
        k = x.shape[-1]
        flat = x.dim() != 2
        rows = x.reshape(-1, k) if flat else x
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        m = rows.shape[0]
        y = torch.empty((m, out_features), dtype=packed.dtype)
        if m:
            code = self._fns[packed.dtype](rows.data_ptr(), m, rows.stride(0), packed.data_ptr(), k, out_features,
                                           None if bias is None else bias.data_ptr(), y.data_ptr(), out_features,
                                           torch.get_num_threads())
            if code:
                raise RuntimeError(f"linear kernel failed (code {code}) on x {tuple(x.shape)} {x.dtype}")
        return y.view(*x.shape[:-1], out_features) if flat else y


# the kernel, built on first use for ODMA_CPU_ISA's instruction set; None where it cannot be (logged at INFO: oneDNN
# is as good a default elsewhere)
load: ckernels.IsaLoader[LinearKernel] = ckernels.IsaLoader(
    SOURCE, LinearKernel, "CPU linear kernel", "linear layers use oneDNN", level=logging.INFO)
