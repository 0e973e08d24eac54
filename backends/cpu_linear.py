"""The CPU backend's fp32 GEMM over column-panel packed weights (csrc/linear_f32.c), called by ctypes.

Why: a decode step reads every weight once for a few rows; oneDNN's fp32 kernel on SmolLM2's shapes waits for
the weight stream and then computes, this one overlaps the two (the measurements: csrc/linear_f32.c and
docs/BENCHMARKS.md, "Session 18"). It needs AVX-512 (built for this CPU); elsewhere `load()` returns None and
the model keeps oneDNN. With OpenMP in the build it splits the panels over torch's threads; without, it is used
only where torch runs one thread (`usable()`).
"""

from __future__ import annotations

import ctypes
import logging

import torch

from backends import ckernels

log = logging.getLogger(__name__)

SOURCE = ckernels.CSRC / "linear_f32.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC")
SERIAL_FLAGS = ("-O3", "-march=native", "-fPIC")  # a compiler without OpenMP
_P, _I = ctypes.c_void_p, ctypes.c_int64


class LinearKernel:
    """y = x @ W.T + b for fp32 CPU tensors, W packed once by `pack`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.odma_linear_f32
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_P, _I, _I, _P, _I, _I, _P, _P, _I, _I]
        self.panel = int(lib.odma_linear_f32_panel())
        self.parallel = bool(lib.odma_linear_f32_openmp())
        # a build without AVX-512 answers -1: refuse it here, not on the first step (tensors held: the call writes)
        probe, packed, out = torch.ones(1, 1), self.pack(torch.full((1, 1), 2.0)), torch.zeros(1, 1)
        if self._fn(probe.data_ptr(), 1, 1, packed.data_ptr(), 1, 1, None, out.data_ptr(), 1, 1) != 0 or out.item() != 2.0:
            raise RuntimeError("linear_f32 was built without AVX-512 for this CPU")

    def usable(self) -> bool:
        """Whether it serves torch's current thread count (a serial build would leave threads idle)."""
        return self.parallel or torch.get_num_threads() == 1

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """W [N, K] → [ceil(N / panel), K, panel] fp32: panel p holds columns p*panel.. of y, k-major, zero-padded."""
        n, k = weight.shape
        panels = -(-n // self.panel)
        padded = torch.zeros(panels * self.panel, k, dtype=torch.float32)
        padded[:n] = weight.detach()
        return padded.view(panels, self.panel, k).transpose(1, 2).contiguous()

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        """x [..., K] fp32 on the CPU; returns [..., out_features]. Lean: it runs ~150 times per model step."""
        k = packed.shape[1]
        flat = x.dim() != 2
        rows = x.reshape(-1, k) if flat else x
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        m = rows.shape[0]
        y = torch.empty((m, out_features), dtype=torch.float32)
        if m:
            code = self._fn(rows.data_ptr(), m, rows.stride(0), packed.data_ptr(), k, out_features,
                            None if bias is None else bias.data_ptr(), y.data_ptr(), out_features,
                            torch.get_num_threads())
            if code:
                raise RuntimeError(f"linear_f32 kernel failed (code {code}) on x {tuple(x.shape)}")
        return y.view(*x.shape[:-1], out_features) if flat else y


_loaded: LinearKernel | None = None
_tried = False


def load() -> LinearKernel | None:
    """The kernel, built if needed; None where it cannot be (reason logged once)."""
    global _loaded, _tried
    if _tried:
        return _loaded
    _tried = True
    if ckernels.disabled():
        log.info("CPU linear kernel disabled by ODMA_CPU_KERNELS=0; linear layers use oneDNN")
        return None
    try:
        _loaded = LinearKernel(ckernels.load_library(SOURCE, (FLAGS, SERIAL_FLAGS)))
    except RuntimeError as e:
        log.info("CPU linear kernel unavailable (%s); linear layers use oneDNN", e)
    return _loaded
