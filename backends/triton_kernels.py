"""Triton kernels over the one KV arena: write the step's K/V into each request's block (rotating q and k on the
way, when asked), decode attention (split over the context, flash-decoding style) and varlen causal attention for
prefill chunks.

Every kernel addresses the arena as one flat tensor of elements. A request's K rows of a layer are found one of
two ways, chosen at compile time by PAGE:
- PAGE == 0, contiguous: the request's block starts at element `base[r]`; a block of capacity C is laid out
  [layers, 2, C, kv_heads, head_dim], so layer L's K row t is at base + L * layer_stride[r] + t * ROW and its V
  row `half[r]` further (layer_stride = 2 * C * ROW, half = C * ROW; ROW = kv_heads * head_dim).
- PAGE > 0, paged: token t lives in page table[r, t // PAGE], each page a block of capacity PAGE in the same
  layout, so the row is at page * page_elems + L * layer_stride[r] + (t % PAGE) * ROW (every request's
  layer_stride and half are the page's). This is the paged baseline: the same code, reading through a table.

With PIECES > 0 (contiguous only), a request reads its first rows from other requests' blocks, a prompt prefix
they hold (the design in docs/results/gpu/replay_policy.md, "A shared prefix read in place"): its table row holds
PIECES ends (the row after each piece; the last piece, its own block, ends past any row), then each piece's
virtual base (the element offset row 0 would have in that block: base - first row * ROW), layer stride and
K-to-V stride, so row t of piece j is at vbase[j] + L * layer_stride[j] + t * ROW. A request without pieces has
one (its own block, ends all past any row): the same addresses as PIECES == 0.

ALIGN (elements) is what the host has checked every row offset to be a multiple of (`triton_attention.alignment`):
the offsets are loaded values, so without the hint the compiler must assume any alignment and reads K and V two
bytes at a time; with it, in 16-byte vectors (cp.async on sm_80+). tests/test_triton_compile.py compiles every
variant for sm_90 and checks the PTX for that.

Nothing here is CUDA-specific (no inline assembly, no vendor intrinsics), so the same source is what a Triton
backend for another accelerator (Cambricon's triton-mlu) compiles. UPCAST computes the dot products in float32:
Triton's interpreter (TRITON_INTERPRET=1, the CPU check) gets bf16 `tl.dot` wrong, so it runs with UPCAST.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rows(r, t, layer, base_ptr, lstride_ptr, table_ptr, table_stride, page_elems, mask,
          ROW: tl.constexpr, PAGE: tl.constexpr, ALIGN: tl.constexpr):
    """Element offsets of K rows `t` of requests `r` (scalars or vectors of the same shape) in `layer`."""
    lstride = tl.load(lstride_ptr + r)
    if PAGE == 0:
        rows = tl.load(base_ptr + r) + layer * lstride + t.to(tl.int64) * ROW
    else:
        page = tl.load(table_ptr + r.to(tl.int64) * table_stride + t // PAGE, mask=mask, other=0).to(tl.int64)
        rows = page * page_elems + layer * lstride + (t % PAGE).to(tl.int64) * ROW
    return tl.multiple_of(rows, ALIGN)


@triton.jit
def _piece_rows(r, t, layer, table_ptr, table_stride, mask, PIECES: tl.constexpr, ROW: tl.constexpr,
                ALIGN: tl.constexpr):
    """Element offsets of K rows `t` of requests `r` in `layer` read through their piece tables (PIECES > 0), and
    each row's K-to-V stride (a piece's block has its own capacity)."""
    entry = table_ptr + r.to(tl.int64) * table_stride
    j = tl.zeros(t.shape, dtype=tl.int32)
    for k in tl.static_range(PIECES - 1):
        j += (t >= tl.load(entry + k)).to(tl.int32)
    vbase = tl.load(entry + PIECES + j, mask=mask, other=0)
    lstride = tl.load(entry + 2 * PIECES + j, mask=mask, other=0)
    half = tl.load(entry + 3 * PIECES + j, mask=mask, other=0)
    rows = vbase + layer * lstride + t.to(tl.int64) * ROW
    return tl.multiple_of(rows, ALIGN), tl.multiple_of(half, ALIGN)


@triton.jit
def _key_rows(r, t, layer, base_ptr, lstride_ptr, half, table_ptr, table_stride, page_elems, mask,
              ROW: tl.constexpr, PAGE: tl.constexpr, ALIGN: tl.constexpr, PIECES: tl.constexpr):
    """(element offsets of K rows `t` of requests `r` in `layer`, their K-to-V strides): through the piece tables
    (PIECES > 0), else `_rows` with each request's `half`."""
    if PIECES > 0:
        rows, halves = _piece_rows(r, t, layer, table_ptr, table_stride, mask, PIECES, ROW, ALIGN)
    else:
        rows = _rows(r, t, layer, base_ptr, lstride_ptr, table_ptr, table_stride, page_elems, mask, ROW, PAGE, ALIGN)
        halves = half
    return rows, halves


@triton.jit
def _fold(kv_ptr, rows, half, kvh, d, tmask, dmask, allowed, q, m, lsum, acc, qk_scale, D: tl.constexpr,
          UPCAST: tl.constexpr, ALIGN: tl.constexpr):
    """Fold one tile of keys (K rows at element offsets `rows`, V rows `half` further) into the running softmax of
    the queries `q`: scores where `allowed`, the running max `m`, sum `lsum` and output `acc` rescaled (exp2: the
    scale includes log2(e))."""
    vrows = tl.multiple_of(rows + half, ALIGN)
    kvmask = tmask[:, None] & dmask[None, :]
    k = tl.load(kv_ptr + rows[:, None] + kvh * D + d[None, :], mask=kvmask, other=0.0)
    v = tl.load(kv_ptr + vrows[:, None] + kvh * D + d[None, :], mask=kvmask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    scores = tl.where(allowed, scores, -1.0e30)
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    lsum = lsum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, lsum, acc


@triton.jit
def _rotate_heads(src_ptr, stride_src, dst_ptr, j64, dst_rows, stride_dst, cos, sin, tmask,
                  HEADS: tl.constexpr, D: tl.constexpr, HALF_B: tl.constexpr):
    """Rotary embedding of HEADS heads of each token: element i < D/2 pairs with i + D/2 (transformers' rotate_half:
    x1 cos - x2 sin, x2 cos + x1 sin), in float32. Destination row of token j: dst_rows[j] when given (the arena),
    else j * stride_dst."""
    i = tl.arange(0, HALF_B)
    mask = tmask[:, None] & (i < D // 2)[None, :]
    if dst_rows is None:
        dst = dst_ptr + j64[:, None] * stride_dst + i[None, :]
    else:
        dst = dst_ptr + dst_rows[:, None] + i[None, :]
    src = src_ptr + j64[:, None] * stride_src + i[None, :]
    for h in range(HEADS):
        x1 = tl.load(src + h * D, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + h * D + D // 2, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst + h * D, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + h * D + D // 2, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split(n, s, split_min, n_splits, BLOCK_N: tl.constexpr):
    """The range [lo, hi) of split s of a context of n tokens: n_splits pieces of whole tiles, at least split_min
    tokens each (splits past the end stay empty)."""
    size = tl.maximum(tl.cdiv(tl.cdiv(n, n_splits), BLOCK_N) * BLOCK_N, split_min)
    lo = s * size
    return lo, tl.minimum(lo + size, n)


@triton.jit
def _group_query(q_ptr, row, stride_q, kvh, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """The GROUP query heads of row `row` that share KV head kvh: (q [BLOCK_G, BLOCK_D], their head ids, the head
    and dim masks, the dim offsets)."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < D
    q = tl.load(q_ptr + row * stride_q + heads[:, None] * D + d[None, :], mask=gmask[:, None] & dmask[None, :],
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return q, heads, gmask, d, dmask


@triton.jit
def _store_decode(out_ptr, part_acc_ptr, part_lse_ptr, row, stride_o, i, s, n_splits, heads, gmask, d, dmask, acc, m,
                  lsum, HEADS: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr):
    """A decode program's normalized result: to out[row] (one split), or with SPLIT its partial and log2-sum-exp to
    part_acc [n, HEADS, n_splits, D] and part_lse [n, HEADS, n_splits] for `reduce_kernel`."""
    safe = tl.where(lsum > 0, lsum, 1.0)
    acc = acc / safe[:, None]
    omask = gmask[:, None] & dmask[None, :]
    if SPLIT:
        part = (i * HEADS + heads).to(tl.int64) * n_splits + s
        tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=omask)
        tl.store(part_lse_ptr + part, tl.where(lsum > 0, m + tl.log2(safe), -1.0e30), mask=gmask)
    else:
        tl.store(out_ptr + row * stride_o + heads[:, None] * D + d[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=omask)


# table_stride (the widest page table of the step) changes from step to step on pages: specialized (1, a multiple
# of 16, other) it compiled new variants inside a burst's steps
@triton.jit(do_not_specialize=["n_tokens", "layer", "table_stride"])
def kv_write_kernel(kv_ptr, q_ptr, k_ptr, v_ptr, q_out_ptr, stride_q, stride_k, stride_v, stride_qo, rotary_ptr,
                    tok_req_ptr, tok_pos_ptr, n_tokens, base_ptr, lstride_ptr, half_ptr, table_ptr, table_stride,
                    page_elems, layer,
                    HEADS: tl.constexpr, D: tl.constexpr, HALF_B: tl.constexpr, ROW: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, PAGE: tl.constexpr, ALIGN: tl.constexpr,
                    ROTARY: tl.constexpr, PIECES: tl.constexpr = 0):
    """k, v [T, ROW] (row strides stride_k, stride_v) → each token's row `tok_pos` of its request's block. With
    ROTARY, k is rotated on the way and q [T, HEADS * D] rotated into q_out, both at position tok_pos (the token's
    place in its sequence is its place in its block), so the model's own rotary ops and a K write are one launch;
    rotary_ptr is the model's table [positions, D]: cos of each frequency, then sin (float32, what the model's own
    rotary computes). A token at position -1 is padding (a captured batch larger than the step): nothing of it is
    written."""
    j = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j64 = j.to(tl.int64)
    jmask = j < n_tokens
    r = tl.load(tok_req_ptr + j, mask=jmask, other=0)
    t = tl.load(tok_pos_ptr + j, mask=jmask, other=-1)
    live = jmask & (t >= 0)
    # (with pieces, a token's row lies in its request's own block, the last piece)
    rows, half = _key_rows(r, t, layer, base_ptr, lstride_ptr, tl.load(half_ptr + r), table_ptr, table_stride,
                           page_elems, live, ROW, PAGE, ALIGN, PIECES)
    vrows = tl.multiple_of(rows + half, ALIGN)
    e = tl.arange(0, BLOCK_R)
    mask = live[:, None] & (e < ROW)[None, :]
    v = tl.load(v_ptr + j64[:, None] * stride_v + e[None, :], mask=mask)
    tl.store(kv_ptr + vrows[:, None] + e[None, :], v.to(kv_ptr.dtype.element_ty), mask=mask)
    if ROTARY:
        i = tl.arange(0, HALF_B)
        cmask = live[:, None] & (i < D // 2)[None, :]
        angles = rotary_ptr + tl.where(live, t, 0).to(tl.int64)[:, None] * D + i[None, :]
        cos = tl.load(angles, mask=cmask, other=1.0)
        sin = tl.load(angles + D // 2, mask=cmask, other=0.0)
        _rotate_heads(k_ptr, stride_k, kv_ptr, j64, rows, 0, cos, sin, live, ROW // D, D, HALF_B)
        _rotate_heads(q_ptr, stride_q, q_out_ptr, j64, None, stride_qo, cos, sin, jmask, HEADS, D, HALF_B)
    else:
        k = tl.load(k_ptr + j64[:, None] * stride_k + e[None, :], mask=mask)
        tl.store(kv_ptr + rows[:, None] + e[None, :], k.to(kv_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["layer", "split_min", "n_splits", "table_stride"])
def decode_kernel(kv_ptr, q_ptr, out_ptr, part_acc_ptr, part_lse_ptr, stride_q, stride_o,
                  dec_req_ptr, dec_row_ptr, lens_ptr, base_ptr, lstride_ptr, half_ptr, table_ptr, table_stride,
                  page_elems, layer, qk_scale, split_min, n_splits,
                  HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, ROW: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  PAGE: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr, ALIGN: tl.constexpr,
                  PIECES: tl.constexpr = 0):
    """One query token per request. Program (i, kv head, split): the GROUP query heads that share the kv head,
    over the split's range of the context, read once. Each request cuts its own context into n_splits pieces of
    whole tiles, at least split_min tokens each (splits past its end stay empty), so the launch depends on nothing
    but the batch: a captured graph replays it for any lengths. qk_scale includes log2(e) (exp2 below). Without
    SPLIT the normalized result goes to out[row]; with it, the split's normalized partial and its log2-sum-exp go
    to part_acc [n, HEADS, n_splits, D] and part_lse [n, HEADS, n_splits] for `reduce_kernel`."""
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    r = tl.load(dec_req_ptr + i)
    row = tl.load(dec_row_ptr + i).to(tl.int64)
    n = tl.load(lens_ptr + r)
    lo, hi = _split(n, s, split_min, n_splits, BLOCK_N)
    q, heads, gmask, d, dmask = _group_query(q_ptr, row, stride_q, kvh, GROUP, D, BLOCK_G, BLOCK_D, UPCAST)
    half = tl.load(half_ptr + r)
    m = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    lsum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        tmask = t < hi
        rows, halves = _key_rows(r, t, layer, base_ptr, lstride_ptr, half, table_ptr, table_stride, page_elems, tmask,
                                 ROW, PAGE, ALIGN, PIECES)
        m, lsum, acc = _fold(kv_ptr, rows, halves, kvh, d, tmask, dmask, tmask[None, :], q, m, lsum, acc, qk_scale,
                             D, UPCAST, ALIGN)
    _store_decode(out_ptr, part_acc_ptr, part_lse_ptr, row, stride_o, i, s, n_splits, heads, gmask, d, dmask, acc, m,
                  lsum, HEADS, D, SPLIT)


@triton.jit(do_not_specialize=["n_splits"])
def reduce_kernel(out_ptr, part_acc_ptr, part_lse_ptr, dec_row_ptr, stride_o, n_splits,
                  HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Combine the splits of one (request, head), one split at a time (online: any number of splits in registers
    of one row): weights 2^(lse - running max), then renormalize. Empty splits (lse -1e30) weigh nothing; a request
    with no context at all (a captured batch's padding) gets zeros."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(dec_row_ptr + i).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    base = (i * HEADS + h).to(tl.int64) * n_splits
    m = -1.0e30
    total = 0.0
    o = tl.zeros([BLOCK_D], dtype=tl.float32)
    for sp in range(0, n_splits):
        lse = tl.load(part_lse_ptr + base + sp)
        part = tl.load(part_acc_ptr + (base + sp) * D + d, mask=dmask, other=0.0)
        m_new = tl.maximum(m, lse)
        keep = tl.exp2(m - m_new)
        w = tl.where(lse > -1.0e29, tl.exp2(lse - m_new), 0.0)
        o = o * keep + part * w
        total = total * keep + w
        m = m_new
    total = tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_o + h * D + d, (o / total).to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit(do_not_specialize=["layer", "table_stride"])
def prefill_kernel(kv_ptr, q_ptr, out_ptr, stride_q, stride_o, tile_req_ptr, tile_m_ptr,
                   q_row_ptr, q_len_ptr, start_ptr, base_ptr, lstride_ptr, half_ptr, table_ptr, table_stride,
                   page_elems, layer, qk_scale,
                   GROUP: tl.constexpr, D: tl.constexpr, ROW: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, UPCAST: tl.constexpr,
                   ALIGN: tl.constexpr, PIECES: tl.constexpr = 0):
    """Causal attention of a chunk of queries (positions start .. start+q_len-1 of request r, packed from row
    q_row[r]) over the request's block [0, start + q_len): the cached tokens (an earlier chunk, a copied prefix)
    and the chunk's own, which the write kernel has stored. Program (tile, head): BLOCK_M queries of one head."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    r = tl.load(tile_req_ptr + tile)
    m0 = tl.load(tile_m_ptr + tile)
    q_len = tl.load(q_len_ptr + r)
    start = tl.load(start_ptr + r)
    row0 = tl.load(q_row_ptr + r).to(tl.int64)
    mi = m0 + tl.arange(0, BLOCK_M)
    mmask = mi < q_len
    pos = start + mi
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    qmask = mmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + (row0 + mi)[:, None] * stride_q + h * D + d[None, :], mask=qmask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    half = tl.load(half_ptr + r)
    m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    lsum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    end = start + tl.minimum(m0 + BLOCK_M, q_len)  # one past the tile's last query position
    for kstart in range(0, end, BLOCK_N):
        t = kstart + tl.arange(0, BLOCK_N)
        tmask = t < end
        rows, halves = _key_rows(r, t, layer, base_ptr, lstride_ptr, half, table_ptr, table_stride, page_elems, tmask,
                                 ROW, PAGE, ALIGN, PIECES)
        causal = (t[None, :] <= pos[:, None]) & tmask[None, :]
        m, lsum, acc = _fold(kv_ptr, rows, halves, kvh, d, tmask, dmask, causal, q, m, lsum, acc, qk_scale, D,
                             UPCAST, ALIGN)
    acc = acc / tl.where(lsum > 0, lsum, 1.0)[:, None]
    tl.store(out_ptr + (row0 + mi)[:, None] * stride_o + h * D + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=qmask)
