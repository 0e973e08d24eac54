"""Attention of a whole packed step in a fixed number of launches per layer, over contiguous blocks or pages.

`TritonAttention.plan_step(slots)` runs once per step: it turns each request's block (a view into the arena) or page
list into small index tensors, moved to the device in one copy. `TritonStep.attend(layer, q, k, v)` then does,
per layer, at most four launches whatever the batch: the K/V write of every packed token, split-K decode
attention for the requests feeding one token (plus the reduction of the splits), and varlen causal attention for
the prefill chunks. The model's loop over requests is gone on this path.

The kernels (`triton_kernels.py`) run compiled on a GPU, and on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1), which is how CI checks them. `available(device)` says whether they can run.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from backends.errors import BackendError

LOG2E = 1.4426950408889634
DEFAULT_PROGRAMS = 264  # decode programs to aim for: two per streaming multiprocessor of an H100/H200


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> str | None:
    """None when the Triton path can run on `device`; otherwise why not (for a log line or an error)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if device.type == "cpu" and not interpreting():
        return "Triton compiles for accelerators only; on CPU it runs only under TRITON_INTERPRET=1 (for tests)"
    return None


@dataclass(frozen=True, slots=True)
class Tuning:
    """Tile sizes. split_tokens: context per decode split (None: chosen so that the step fills `programs`)."""

    decode_block_n: int = 64
    prefill_block_m: int = 64
    prefill_block_n: int = 64
    write_block_t: int = 16
    programs: int = DEFAULT_PROGRAMS
    split_tokens: int | None = None
    max_splits: int = 256


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def device_programs(device: torch.device) -> int:
    """Decode programs that keep `device` busy: twice its multiprocessors (a guess where they are unknown)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_PROGRAMS


class TritonAttention:
    """The step-level attention of one backend (one per model runner)."""

    def __init__(self, device: torch.device, tuning: Tuning | None = None) -> None:
        why = available(device)
        if why is not None:
            raise BackendError(f"Triton attention unavailable on {device}: {why}")
        from backends import triton_kernels

        self.kernels = triton_kernels
        self.device = device
        self.tuning = tuning or Tuning(programs=device_programs(device))

    def plan_step(self, slots: Sequence) -> TritonStep:
        """`slots`: the step's requests in packed order, each with `kv` (its block view [layers, 2, capacity,
        kv_heads, head_dim], or for a paged request the arena viewed as pages [pages, layers, 2, PAGE, kv_heads,
        head_dim]), `pages` (None, or the request's page ids in order), `start` (tokens cached) and `q_len`."""
        if not slots:
            raise BackendError("an attention step needs at least one request")
        paged = slots[0].pages is not None
        if any((s.pages is not None) != paged for s in slots):
            raise BackendError("a step mixes paged and contiguous requests")
        kv0 = slots[0].kv
        storage = _flat_storage(kv0)
        layers, _, _, kv_heads, head_dim = kv0.shape[-5:]
        row = kv_heads * head_dim
        n = len(slots)
        starts = [s.start for s in slots]
        q_lens = [s.q_len for s in slots]
        lens = [a + b for a, b in zip(starts, q_lens)]
        if paged:
            addr = _paged_addresses(slots, lens, layers, row)
        else:
            addr = _block_addresses(slots, lens, storage, kv_heads, head_dim)
        base, lstride, half, table, page, page_elems = addr
        width = len(table[0])
        t = self.tuning
        blocks = _tiles(t, kv0.element_size())
        decode = [i for i, q in enumerate(q_lens) if q == 1]
        prefill = [i for i, q in enumerate(q_lens) if q > 1]
        q_rows = [0] * n
        for i in range(1, n):
            q_rows[i] = q_rows[i - 1] + q_lens[i - 1]
        tiles = [(i, m) for i in prefill for m in range(0, q_lens[i], blocks[1])]
        # one host tensor, one copy to the device; the views below slice it
        per_req = torch.tensor([base, lstride, half, lens, starts, q_lens, q_rows], dtype=torch.int64)
        tok_req = torch.repeat_interleave(torch.arange(n), torch.tensor(q_lens))
        tok_pos = torch.arange(int(sum(q_lens))) - torch.tensor(q_rows).repeat_interleave(torch.tensor(q_lens))
        tok_pos += torch.tensor(starts).repeat_interleave(torch.tensor(q_lens))
        dec = torch.tensor([decode, [q_rows[i] for i in decode]], dtype=torch.int64).view(2, -1)
        til = torch.tensor([[a for a, _ in tiles], [b for _, b in tiles]], dtype=torch.int64).view(2, -1)
        host = torch.cat([per_req.flatten(), tok_req, tok_pos, dec.flatten(), til.flatten(),
                          torch.tensor(table, dtype=torch.int64).flatten()])
        dev = host.to(self.device, non_blocking=True)
        views = torch.split(dev, [7 * n, len(tok_req), len(tok_pos), dec.numel(), til.numel(), n * width])
        req = views[0].view(7, n)
        step = TritonStep(
            kernels=self.kernels, storage=storage, row=row, head_dim=head_dim, page=page, page_elems=page_elems,
            table=views[5].view(n, width), table_stride=width, base=req[0], lstride=req[1], half=req[2],
            lens=req[3], starts=req[4], q_lens=req[5], q_rows=req[6], tok_req=views[1], tok_pos=views[2],
            n_tokens=len(tok_req), dec_req=views[3].view(2, -1)[0], dec_row=views[3].view(2, -1)[1],
            n_decode=len(decode), tile_req=views[4].view(2, -1)[0], tile_m=views[4].view(2, -1)[1],
            n_tiles=len(tiles), tuning=t, blocks=blocks, upcast=interpreting() and kv0.dtype == torch.bfloat16,
            picked=frozenset(range(n)),
        )
        step.choose_splits(max((lens[i] for i in decode), default=0), kv_heads)
        return step


@dataclass(slots=True)
class TritonStep:
    """One step's plan: index tensors on the device, used by every layer. Covers every request of the step, so
    `rows` is None (the model hands it all packed rows)."""

    kernels: object
    storage: torch.Tensor
    row: int
    head_dim: int
    page: int
    page_elems: int
    table: torch.Tensor
    table_stride: int
    base: torch.Tensor
    lstride: torch.Tensor
    half: torch.Tensor
    lens: torch.Tensor
    starts: torch.Tensor
    q_lens: torch.Tensor
    q_rows: torch.Tensor
    tok_req: torch.Tensor
    tok_pos: torch.Tensor
    n_tokens: int
    dec_req: torch.Tensor
    dec_row: torch.Tensor
    n_decode: int
    tile_req: torch.Tensor
    tile_m: torch.Tensor
    n_tiles: int
    tuning: Tuning
    blocks: tuple[int, int, int]  # decode key tile, prefill query tile, prefill key tile (`_tiles`)
    upcast: bool
    picked: frozenset[int]
    rows: None = None
    split_tokens: int = 0
    n_splits: int = 1
    partials: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.storage.dtype

    def choose_splits(self, longest: int, kv_heads: int) -> None:
        """Decode splits: enough programs to fill the device (a batch of 1 at 16K still does), never a split
        shorter than one tile; every request uses the same split length, shorter ones leave splits empty."""
        t = self.tuning
        if not self.n_decode:
            return
        tile = self.blocks[0]
        if t.split_tokens is not None:
            size = max(t.split_tokens, 1)
        else:
            want = max(1, math.ceil(t.programs / (self.n_decode * kv_heads)))
            size = max(tile, -(-longest // want))
            size = -(-size // tile) * tile
        self.n_splits = max(1, -(-longest // size))
        if self.n_splits > t.max_splits:
            self.n_splits = t.max_splits
            size = -(-longest // t.max_splits)
        self.split_tokens = size

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads, dim], k/v [T, kv_heads, dim] of every packed token: writes k, v into each request's block
        at its positions and returns the attention output [T, heads, dim] (q's dtype)."""
        kern, t = self.kernels, self.tuning
        heads, dim = q.shape[1], q.shape[2]
        if q.stride(2) != 1 or q.stride(1) != dim:
            q = q.contiguous()
        k2, v2 = _rows2d(k), _rows2d(v)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        addr = (self.base, self.lstride, self.half, self.table, self.table_stride, self.page_elems)
        kern.kv_write_kernel[(triton_cdiv(self.n_tokens, t.write_block_t),)](
            self.storage, k2, v2, k2.stride(0), v2.stride(0), self.tok_req, self.tok_pos, self.n_tokens,
            *addr, layer, ROW=self.row, BLOCK_T=t.write_block_t, BLOCK_R=_pow2(self.row), PAGE=self.page)
        group = heads // (self.row // dim)
        scale = dim ** -0.5 * LOG2E
        block_d = _pow2(dim)
        block_n, block_m, block_pn = self.blocks
        if self.n_decode:
            split = self.n_splits > 1
            if split:
                acc = torch.empty((self.n_decode, heads, self.n_splits, dim), dtype=torch.float32, device=q.device)
                lse = torch.empty((self.n_decode, heads, self.n_splits), dtype=torch.float32, device=q.device)
            else:
                acc = lse = out  # unused
            kern.decode_kernel[(self.n_decode, self.row // dim, self.n_splits)](
                self.storage, q, out, acc, lse, q.stride(0), out.stride(0), self.dec_req, self.dec_row, self.lens,
                self.base, self.lstride, self.half, self.table, self.table_stride, self.page_elems, layer, scale,
                self.split_tokens, self.n_splits, HEADS=heads, GROUP=group, D=dim, ROW=self.row,
                BLOCK_G=max(16, _pow2(group)), BLOCK_D=block_d, BLOCK_N=block_n, PAGE=self.page,
                SPLIT=split, UPCAST=self.upcast)
            if split:
                kern.reduce_kernel[(self.n_decode, heads)](
                    out, acc, lse, self.dec_row, out.stride(0), self.n_splits, HEADS=heads, D=dim, BLOCK_D=block_d)
        if self.n_tiles:
            kern.prefill_kernel[(self.n_tiles, heads)](
                self.storage, q, out, q.stride(0), out.stride(0), self.tile_req, self.tile_m, self.q_rows,
                self.q_lens, self.starts, self.base, self.lstride, self.half, self.table, self.table_stride,
                self.page_elems, layer, scale, GROUP=group, D=dim, ROW=self.row, BLOCK_M=block_m,
                BLOCK_N=block_pn, BLOCK_D=block_d, PAGE=self.page, UPCAST=self.upcast)
        return out


def _block_addresses(slots: Sequence, lens: list[int], storage: torch.Tensor, kv_heads: int, head_dim: int):
    """Contiguous blocks: each one's element offset in `storage` and its per-layer and K-to-V strides."""
    kv0, elem = slots[0].kv, storage.element_size()
    base, lstride, half = [], [], []
    for s, need in zip(slots, lens):
        kv = s.kv
        if kv.dtype != kv0.dtype or tuple(kv.shape[-2:]) != (kv_heads, head_dim) or not _rows_contiguous(kv):
            raise BackendError("blocks of one step must share dtype and head shape, rows contiguous")
        if need > kv.shape[2]:
            raise BackendError(f"a block of {kv.shape[2]} tokens cannot hold {need} tokens")
        offset = kv.data_ptr() - storage.data_ptr()  # blocks of other segments: relative to the first
        if offset % elem:
            raise BackendError("a block is not aligned to its elements")
        base.append(offset // elem)
        lstride.append(kv.stride(0))
        half.append(kv.stride(1))
    return base, lstride, half, [[0]] * len(slots), 0, 0


def _paged_addresses(slots: Sequence, lens: list[int], layers: int, row: int):
    """Pages (blocks of PAGE tokens): every request's page table, padded to the longest, and the page's strides."""
    page = slots[0].kv.shape[-3]
    width = max(max(len(s.pages) for s in slots), 1)
    for s, need in zip(slots, lens):
        if len(s.pages) * page < need:
            raise BackendError(f"{len(s.pages)} pages of {page} tokens cannot hold {need} tokens")
    n = len(slots)
    table = [list(s.pages) + [0] * (width - len(s.pages)) for s in slots]
    return [0] * n, [2 * page * row] * n, [page * row] * n, table, page, page * layers * 2 * row


def _tiles(t: Tuning, element_size: int) -> tuple[int, int, int]:
    """(decode key tile, prefill query tile, prefill key tile): fp32 tiles hold twice the bytes, so they are halved
    (at most 32) to keep pipelined K/V tiles within a multiprocessor's shared memory."""
    if element_size >= 4:
        return min(t.decode_block_n, 32), min(t.prefill_block_m, 32), min(t.prefill_block_n, 32)
    return t.decode_block_n, t.prefill_block_m, t.prefill_block_n


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rows2d(x: torch.Tensor) -> torch.Tensor:
    """[T, kv_heads, dim] with each token's heads packed → [T, kv_heads * dim] (a view when it can be)."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x.as_strided((x.shape[0], x.shape[1] * x.shape[2]), (x.stride(0), 1))


def _rows_contiguous(kv: torch.Tensor) -> bool:
    heads, dim = kv.shape[-2:]
    return kv.stride(-1) == 1 and kv.stride(-2) == dim and kv.stride(-3) == heads * dim


def _flat_storage(kv: torch.Tensor) -> torch.Tensor:
    """The whole storage under a view, as one flat tensor of its dtype (what the kernels index)."""
    storage = kv.untyped_storage()
    return torch.empty(0, dtype=kv.dtype, device=kv.device).set_(storage, 0, (storage.nbytes() // kv.element_size(),))
