"""Triton kernels over a paged KV cache in per-head planes (vLLM's LHBNC layout: [kv_heads, blocks * block_size,
2 * head_dim] per layer, a row holding a token's K then its V): the decode attention and K/V write of odma's vLLM
backend on an accelerator, the Triton twin of csrc/run_attention.c.

A request's token t is row `first + t` of every plane when its blocks are one run of consecutive ids (`first` is
its first block's first row: one range, read as a stream), else row `table[t // BS] * BS + t % BS` (`first` = -1:
read through its block table, as any paged kernel reads). Both are the same program: the table load is masked off
for runs, so a batch mixes them and "paged" reading (every `first` -1) differs from "runs" by the layout alone.

The splits, the query heads' load, the online softmax (`_split`, `_group_query`, `_fold`) and the split reduction
(`reduce_kernel`) are the arena kernels' own (triton_kernels.py), so both accelerator paths compute alike.
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.triton_kernels import _fold, _group_query, _split, _store_decode


@triton.jit(do_not_specialize=["table_stride", "plane_stride", "split_min", "n_splits"])
def run_decode_kernel(planes_ptr, q_ptr, out_ptr, part_acc_ptr, part_lse_ptr, stride_q, stride_o, q_rows_ptr,
                      lens_ptr, first_ptr, table_ptr, table_stride, plane_stride, qk_scale, split_min, n_splits,
                      HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, SPLIT: tl.constexpr,
                      UPCAST: tl.constexpr, ALIGN: tl.constexpr):
    """One query token per request (row q_rows[i] of q and out). Program (i, kv head, split): the GROUP query heads
    sharing the kv head over the split's range of the request's lens[i] tokens. Splits as in `decode_kernel`:
    without SPLIT the normalized result goes to out, with it the partials to part_acc / part_lse for
    `reduce_kernel`."""
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    row = tl.load(q_rows_ptr + i).to(tl.int64)
    n = tl.load(lens_ptr + i)
    first = tl.load(first_ptr + i)
    paged = (tl.full([BLOCK_N], 0, dtype=tl.int64) + first) < 0  # a vector: the interpreter masks with vectors only
    lo, hi = _split(n, s, split_min, n_splits, BLOCK_N)
    q, heads, gmask, d, dmask = _group_query(q_ptr, row, stride_q, kvh, GROUP, D, BLOCK_G, BLOCK_D, UPCAST)
    plane = kvh.to(tl.int64) * plane_stride  # in the row offsets, which carry the alignment hint
    m = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    lsum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        tmask = t < hi
        block = tl.load(table_ptr + i.to(tl.int64) * table_stride + t // BS, mask=tmask & paged,
                        other=0).to(tl.int64)
        token_rows = tl.where(first >= 0, first + t, block * BS + t % BS)
        rows = tl.multiple_of(plane + token_rows * (2 * D), ALIGN)
        m, lsum, acc = _fold(planes_ptr, rows, D, 0, d, tmask, dmask, tmask[None, :], q, m, lsum, acc, qk_scale, D,
                             UPCAST, ALIGN)
    _store_decode(out_ptr, part_acc_ptr, part_lse_ptr, row, stride_o, i, s, n_splits, heads, gmask, d, dmask, acc, m,
                  lsum, HEADS, D, SPLIT)


@triton.jit(do_not_specialize=["n_tokens", "plane_stride"])
def run_write_kernel(planes_ptr, k_ptr, v_ptr, slots_ptr, n_tokens, stride_k, stride_v, plane_stride,
                     D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """k, v [tokens, kv_heads, D] (heads packed) → row slots[j] of every plane; a slot < 0 (padding) is skipped.
    Program (token tile, kv head)."""
    j = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    jmask = j < n_tokens
    slot = tl.load(slots_ptr + j, mask=jmask, other=-1)
    live = jmask & (slot >= 0)
    d = tl.arange(0, BLOCK_D)
    mask = live[:, None] & (d < D)[None, :]
    j64 = j.to(tl.int64)
    k = tl.load(k_ptr + j64[:, None] * stride_k + h * D + d[None, :], mask=mask)
    v = tl.load(v_ptr + j64[:, None] * stride_v + h * D + d[None, :], mask=mask)
    dst = planes_ptr + h.to(tl.int64) * plane_stride + tl.where(live, slot, 0)[:, None] * (2 * D) + d[None, :]
    tl.store(dst, k.to(planes_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + D, v.to(planes_ptr.dtype.element_ty), mask=mask)
