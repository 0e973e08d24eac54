"""The CPU kernel that reads a paged KV cache laid out in per-head planes, a run of consecutive block ids as one
range of rows (csrc/run_attention.c; built on first use, called by ctypes): decode attention for the requests of a
step that feed one token, and the write of a step's new K/V rows at their slots.

The layout is vLLM's LHBNC ([layers, kv_heads, blocks, block_size, 2 * head_dim]: a row holds a token's K then its
V), which odma's vLLM attention backend asks vLLM for (odma/vllm/attention.py). With `coalesce` (the default) a
request whose blocks are one run is read as one sequential stream per KV head; without it every block is read
apart, as any paged kernel reads: the same data and arithmetic, so the two differ by the layout's effect alone.

No compiler, a failed build or ODMA_CPU_KERNELS=0: `load()` returns None (logged once).
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor

import torch

from backends import ckernels
from backends.cpu_attention import FLAGS, PORTABLE_FLAGS, _shares
from backends.errors import BackendError

SOURCE = ckernels.CSRC / "run_attention.c"
_P, _I = ctypes.c_void_p, ctypes.c_int64


class RunAttention:
    dtypes = (torch.float32,)  # the caches it reads

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._decode = lib.odma_run_decode_f32
        self._decode.restype = ctypes.c_int
        self._decode.argtypes = [_P, _I, _I, _P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float,
                                 ctypes.c_int]
        self._write = lib.odma_run_write_f32
        self._write.restype = None
        self._write.argtypes = [_P, _I, _P, _I, _P, _I, _P, _I, _I, _I]
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    def first_rows(self, block_table, seq_lens, block_size, coalesce) -> None:
        """None: this kernel finds a request's runs itself as it reads (the Triton kernels take them planned)."""
        return None

    def decode(self, planes: torch.Tensor, block_size: int, block_table: torch.Tensor, seq_lens: torch.Tensor,
               q_rows: torch.Tensor, q: torch.Tensor, out: torch.Tensor, scale: float, *, coalesce: bool = True,
               workers: int = 1, longest: int | None = None, first: None = None) -> None:
        """planes: [kv_heads, blocks * block_size, 2 * head_dim] float32, rows contiguous (one layer's cache);
        block_table int32 [requests, width]; seq_lens int32 [requests] (tokens to attend, this step's included);
        q_rows int64 [requests]: each request's row of q [tokens, heads, head_dim] and of out (same shape), which
        is written. `longest` and `first` (the Triton kernels' split hint and run plan) mean nothing here."""
        del longest, first
        _check(planes, q, out, block_table, seq_lens, q_rows)
        kv_heads, heads, dim = plane_geometry(planes, q, block_size)
        n = seq_lens.shape[0]
        if n == 0:
            return

        def run(lo: int, hi: int) -> int:
            return self._decode(planes.data_ptr(), planes.stride(0), block_size, block_table.data_ptr(),
                                block_table.stride(0), seq_lens.data_ptr(), q_rows.data_ptr(), q.data_ptr(),
                                q.stride(0), out.data_ptr(), out.stride(0), lo, hi, heads, kv_heads, dim, scale,
                                int(coalesce))

        shares = _shares(seq_lens.tolist(), workers) if workers > 1 else [(0, n)]
        if len(shares) == 1:
            codes = [run(0, n)]
        else:
            if self._pool_size < len(shares):
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(len(shares), thread_name_prefix="odma-runs")
                self._pool_size = len(shares)
            codes = list(self._pool.map(lambda share: run(*share), shares))
        if any(codes):
            raise BackendError(f"run attention kernel refused the shape (heads {heads}, kv_heads {kv_heads}, "
                               f"head_dim {dim})")

    def write(self, planes: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """key, value [tokens, kv_heads, head_dim] float32 → row slots[t] of every plane (slot < 0: skipped)."""
        kv_heads, _, width = planes.shape
        if key.dtype != torch.float32 or value.dtype != torch.float32 or slots.dtype != torch.int64:
            raise BackendError("the run kernel writes float32 K/V at int64 slots")
        if key.stride(2) != 1 or key.stride(1) != key.shape[2] or value.stride(2) != 1 or \
                value.stride(1) != value.shape[2] or not slots.is_contiguous():
            raise BackendError("K/V rows must hold their heads packed, slots contiguous")
        self._write(planes.data_ptr(), planes.stride(0), key.data_ptr(), key.stride(0), value.data_ptr(),
                    value.stride(0), slots.data_ptr(), slots.shape[0], kv_heads, key.shape[2])


def one_run(table: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """bool [requests]: whether each request's first `blocks` ids (block table rows) are consecutive, on the
    table's device."""
    if table.shape[1] < 2:
        return torch.ones(table.shape[0], dtype=torch.bool, device=table.device)
    steps = (table[:, 1:] - table[:, :-1]) == 1
    needed = torch.arange(1, table.shape[1], device=table.device)[None, :] < blocks[:, None]
    return (steps | ~needed).all(dim=1)


def plane_geometry(planes: torch.Tensor, q: torch.Tensor, block_size: int) -> tuple[int, int, int]:
    """(kv_heads, heads, head_dim) of planes [kv_heads, blocks * block_size, 2 * head_dim] read by queries q [tokens,
    heads, head_dim]; refused in words where they do not fit."""
    kv_heads, rows, width = planes.shape
    heads, dim = q.shape[1], q.shape[2]
    if width != 2 * dim or rows % block_size:
        raise BackendError(f"planes of {width}-element rows and {rows} rows do not hold blocks of {block_size} "
                           f"tokens of head_dim {dim}")
    if heads % kv_heads:
        raise BackendError(f"{heads} query heads do not share {kv_heads} KV heads evenly")
    return kv_heads, heads, dim


def _check(planes, q, out, block_table, seq_lens, q_rows) -> None:
    if planes.dtype != torch.float32 or q.dtype != torch.float32 or out.dtype != torch.float32:
        raise BackendError("the run kernel reads float32 caches and queries")
    check_layouts(planes, q, out, block_table, seq_lens, q_rows)


def check_layouts(planes, q, out, block_table, seq_lens, q_rows) -> None:
    """What every run kernel reads: contiguous plane rows, query and output rows with their heads packed, int32
    tables and lengths, int64 query rows, each contiguous."""
    if planes.stride(2) != 1 or planes.stride(1) != planes.shape[2]:
        raise BackendError("a plane's rows must be contiguous")
    for x in (q, out):
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            raise BackendError("query and output rows must hold their heads packed")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32 or q_rows.dtype != torch.int64:
        raise BackendError("block tables and lengths are int32, query rows int64")
    if not (seq_lens.is_contiguous() and q_rows.is_contiguous() and block_table.stride(1) == 1):
        raise BackendError("lengths, query rows and each block-table row must be contiguous")


# the kernel, built on first use; None where it cannot be
load: ckernels.Loader[RunAttention] = ckernels.Loader(
    SOURCE, (FLAGS, PORTABLE_FLAGS), RunAttention, "CPU run-reading attention kernel",
    "vLLM's own CPU attention runs instead", link=("-lm",))
