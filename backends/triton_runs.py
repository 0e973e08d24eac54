"""Run-reading attention on an accelerator: decode attention and the K/V write over per-head planes (vLLM's LHBNC
layout) in Triton (triton_run_kernels.py), with the interface of the CPU kernel (run_attention.py), so odma's vLLM
backend calls either alike.

Each call plans on the device (which requests are one run, their first rows) without reading anything back to the
host; the decode splits follow the longest context, which the caller passes where it knows it (vLLM's metadata
does), else one read of the lengths decides them.
"""

from __future__ import annotations

import math

import torch

from backends.errors import BackendError
from backends.run_attention import check_layouts, plane_geometry
from backends.run_attention import one_run
from backends.triton_attention import (
    Tuning, _pow2, _tiles, alignment, available, decode_splits, device_programs, interpreting, triton_cdiv,
)

WRITE_BLOCK_T = 16


class TritonRunAttention:
    dtypes = (torch.float32, torch.bfloat16, torch.float16)  # the caches it reads

    def __init__(self, device: torch.device, tuning: Tuning | None = None) -> None:
        why = available(device)
        if why is not None:
            raise BackendError(f"Triton run attention unavailable on {device}: {why}")
        from backends import triton_kernels, triton_run_kernels

        self.kernels, self.run_kernels = triton_kernels, triton_run_kernels
        self.device = device
        self.tuning = tuning or Tuning(programs=device_programs(device))
        self._partials: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # split buffers, reused by every layer

    def first_rows(self, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                   coalesce: bool) -> torch.Tensor:
        """int64 [requests]: the first row of each request whose blocks up to its length are one run of consecutive
        ids, -1 for the others (every request without `coalesce`). On the device, no read back."""
        n = block_table.shape[0]
        if not coalesce or n == 0:
            return torch.full((n,), -1, dtype=torch.int64, device=block_table.device)
        runs = one_run(block_table, (seq_lens.to(torch.int64) + block_size - 1) // block_size)
        return torch.where(runs, block_table[:, 0].to(torch.int64) * block_size, -1)

    def decode(self, planes: torch.Tensor, block_size: int, block_table: torch.Tensor, seq_lens: torch.Tensor,
               q_rows: torch.Tensor, q: torch.Tensor, out: torch.Tensor, scale: float, *, coalesce: bool = True,
               workers: int = 1, longest: int | None = None, first: torch.Tensor | None = None) -> None:
        """As RunAttention.decode (planes [kv_heads, blocks * block_size, 2 * head_dim], block_table int32, seq_lens
        int32 with this step's token, q_rows int64, q/out [tokens, heads, head_dim]), on the planes' device, in
        their dtype (float32, bfloat16 or float16). `workers` is the CPU kernel's and means nothing here; `longest`:
        a bound on seq_lens (read from them when None); `first`: `first_rows` of this step, made once for all its
        layers (made here when None)."""
        del workers
        _check(planes, q, out, block_table, seq_lens, q_rows)
        kv_heads, heads, dim = plane_geometry(planes, q, block_size)
        n = seq_lens.shape[0]
        if n == 0:
            return
        if longest is None:
            longest = int(seq_lens.max())
        block_n = _tiles(self.tuning, planes.element_size())[0]
        split_min, n_splits = decode_splits(self.tuning, block_n, longest, n, kv_heads)
        split = n_splits > 1
        if first is None:
            first = self.first_rows(block_table, seq_lens, block_size, coalesce)
        group = heads // kv_heads
        if split:  # launches are ordered on the stream, so the next layer may reuse what this one reduced
            key = (n, heads, n_splits, dim, q.device)
            if key not in self._partials:
                self._partials = {key: (torch.empty((n, heads, n_splits, dim), dtype=torch.float32, device=q.device),
                                        torch.empty((n, heads, n_splits), dtype=torch.float32, device=q.device))}
            acc, lse = self._partials[key]
        else:
            acc = lse = out  # unused
        upcast = interpreting() and planes.dtype == torch.bfloat16
        align = alignment(math.gcd(dim, planes.stride(0)), planes.element_size())
        self.run_kernels.run_decode_kernel[(n, kv_heads, n_splits)](
            planes, q, out, acc, lse, q.stride(0), out.stride(0), q_rows, seq_lens, first, block_table,
            block_table.stride(0), planes.stride(0), scale * 1.4426950408889634, split_min, n_splits, HEADS=heads,
            GROUP=group, D=dim, BLOCK_G=max(16, _pow2(group)), BLOCK_D=_pow2(dim), BLOCK_N=block_n, BS=block_size,
            SPLIT=split, UPCAST=upcast, ALIGN=align)
        if split:
            self.kernels.reduce_kernel[(n, heads)](out, acc, lse, q_rows, out.stride(0), n_splits, HEADS=heads, D=dim,
                                                   BLOCK_D=_pow2(dim))

    def write(self, planes: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """key, value [tokens, kv_heads, head_dim] → row slots[t] of every plane (slot < 0: skipped)."""
        kv_heads, _, width = planes.shape
        dim = key.shape[2]
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            raise BackendError("the run kernel writes at contiguous int64 slots")
        if width != 2 * dim or key.shape[1] != kv_heads or value.shape != key.shape:
            raise BackendError(f"K/V of {key.shape[1]} heads of {dim} do not fit planes of {kv_heads} heads of "
                               f"{width}-element rows")
        if key.stride(2) != 1 or key.stride(1) != dim or value.stride(2) != 1 or value.stride(1) != dim:
            raise BackendError("K/V rows must hold their heads packed")
        n = slots.shape[0]
        if n == 0:
            return
        self.run_kernels.run_write_kernel[(triton_cdiv(n, WRITE_BLOCK_T), kv_heads)](
            planes, key, value, slots, n, key.stride(0), value.stride(0), planes.stride(0), D=dim,
            BLOCK_T=WRITE_BLOCK_T, BLOCK_D=_pow2(dim))


def _check(planes, q, out, block_table, seq_lens, q_rows) -> None:
    if not q.dtype == out.dtype == planes.dtype:
        raise BackendError(f"queries in {q.dtype} and output in {out.dtype} over a {planes.dtype} cache: one dtype")
    check_layouts(planes, q, out, block_table, seq_lens, q_rows)
    devices = {x.device for x in (planes, q, out, block_table, seq_lens, q_rows)}
    if len(devices) > 1:
        raise BackendError(f"the run kernel's tensors are on several devices: {sorted(map(str, devices))}")
