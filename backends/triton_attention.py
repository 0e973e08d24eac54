"""Attention of a whole packed step in a fixed number of launches per layer, over contiguous blocks or pages.

`TritonAttention.plan_step(slots)` runs once per step: the host puts five integers per request (where its block
is, where this step's tokens go) and the page tables into one tensor, moved to the device in one copy; every other
index the kernels need (each token's request and position, which requests decode, the prefill tiles, each
request's last row) is derived from it there, so planning never waits for the device. `TritonStep.attend(layer,
q, k, v)` then does, per layer, at most four launches whatever the batch: the K/V write of every packed token
(rotating q and k on the way when the step was planned with the model's rotary frequencies), split-K decode
attention for the requests feeding one token (plus the reduction of the splits), and varlen causal attention for
the prefill chunks. The model's loop over requests is gone on this path.

`TritonAttention.static_decode(max_batch, ...)` is the same step over buffers that never move, for decode steps
captured once as a graph and replayed (odma/engine/decode_graphs.py): the host refills them, the launches stay.

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
VECTOR_BYTES = 16  # the widest load a thread issues (ld.global.v4.b32, cp.async 16)
FIELDS = 5  # per request: base, layer stride, K-to-V stride, tokens cached, tokens fed
# which Triton backends compile for which torch device type (Triton's active driver names its backend)
TRITON_BACKENDS = {"cuda": ("cuda", "hip"), "mlu": ("mlu",)}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device) -> str | None:
    """None when the Triton path can run on `device` (a torch.device, or anything with its `type`); otherwise why
    not (for a log line or an error). On an accelerator, Triton's active backend must be the device's: stock
    Triton on a Cambricon host compiles for no MLU, so its kernels could not launch there."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if device.type == "cpu":
        if interpreting():
            return None
        return "Triton compiles for accelerators only; on CPU it runs only under TRITON_INTERPRET=1 (for tests)"
    wanted = TRITON_BACKENDS.get(device.type, (device.type,))
    active = active_backend()
    if active not in wanted:
        return (f"Triton's active backend is {active or 'none'}, not one that compiles for {device.type} "
                f"({', '.join(wanted)})")
    return None


def active_backend() -> str | None:
    """The backend Triton compiles for on this machine (cuda, hip, mlu...), None where it finds no device."""
    try:
        from triton.runtime import driver

        return driver.active.get_current_target().backend
    except Exception:  # noqa: BLE001 - no driver, no device: Triton raises various errors
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


def alignment(divisor: int, element_size: int) -> int:
    """The ALIGN hint the kernels may be given: the largest power of two dividing `divisor` (the gcd of every row
    offset, in elements), at most one vector's worth of elements. The host computes it from the offsets it
    hands over, so the hint is never a promise it has not checked."""
    widest = max(1, VECTOR_BYTES // element_size)
    if divisor == 0:
        return widest
    return min(widest, divisor & -divisor)


INTERPRETED_PROGRAMS = 8  # Triton's interpreter runs programs one after another: splitting only slows it


def device_programs(device: torch.device) -> int:
    """Decode programs that keep `device` busy: twice its multiprocessors (a guess where they are unknown)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "cpu":
        return INTERPRETED_PROGRAMS
    return DEFAULT_PROGRAMS


def compiled_variants() -> dict[str, int]:
    """Variants of each of odma's Triton kernels compiled in this process so far (each specialization of a kernel's
    arguments is compiled once; a count that grows while requests are served is compile time inside a step).
    Empty where Triton does not compile (not importable, or its interpreter)."""
    import sys

    counts: dict[str, int] = {}
    for module_name in ("backends.triton_kernels", "backends.triton_run_kernels"):
        module = sys.modules.get(module_name)
        if module is None:  # never imported: nothing compiled
            continue
        for name, fn in vars(module).items():
            caches = getattr(fn, "device_caches", None)  # per device: (compiled kernels by key, ...)
            if name.endswith("_kernel") and caches:
                counts[name] = sum(len(cache[0]) for cache in caches.values())
    return counts


class TritonAttention:
    """The step-level attention of one backend (one per model runner)."""

    fuses_rotary = True  # plan_step takes the model's rotary frequencies and rotates q and k in the K/V write

    def __init__(self, device: torch.device, tuning: Tuning | None = None) -> None:
        why = available(device)
        if why is not None:
            raise BackendError(f"Triton attention unavailable on {device}: {why}")
        from backends import triton_kernels

        self.kernels = triton_kernels
        self.device = device
        self.tuning = tuning or Tuning(programs=device_programs(device))
        self._staging: torch.Tensor | None = None  # page-locked, so that the plan's copy waits for nothing
        self._staged: object | None = None  # an event after the last copy out of it

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """One copy of the step's integers to the device. From pageable memory CUDA would first wait for the
        stream; from the page-locked staging buffer the copy is queued and the host goes on."""
        if self.device.type != "cuda":
            return host.to(self.device)
        if self._staged is not None:
            self._staged.synchronize()  # the previous plan's copy has left the buffer (long since, in practice)
        if self._staging is None or self._staging.numel() < host.numel():
            self._staging = torch.empty(max(host.numel(), 4096), dtype=torch.int64, pin_memory=True)
        staging = self._staging[:host.numel()]
        staging.copy_(host)
        dev = staging.to(self.device, non_blocking=True)
        self._staged = torch.cuda.Event()
        self._staged.record()
        return dev

    def plan_step(self, slots: Sequence, rotary: torch.Tensor | None = None) -> TritonStep:
        """`slots`: the step's requests in packed order, each with `kv` (its block view [layers, 2, capacity,
        kv_heads, head_dim], or for a paged request the arena viewed as pages [pages, layers, 2, PAGE, kv_heads,
        head_dim]), `pages` (None, or the request's page ids in order), `start` (tokens cached) and `q_len`.
        rotary: the model's rotary table [positions, head_dim] (cos, then sin, float32; `Rotary.table`): attend()
        then takes q and k before their rotary embedding and applies it itself."""
        if not slots:
            raise BackendError("an attention step needs at least one request")
        paged = slots[0].pages is not None
        if any((s.pages is not None) != paged for s in slots):
            raise BackendError("a step mixes paged and contiguous requests")
        kv0 = slots[0].kv
        storage = _flat_storage(kv0)
        layers, _, _, kv_heads, head_dim = kv0.shape[-5:]
        row = kv_heads * head_dim
        pieces = 0
        if paged:
            fields, table, page, page_elems = _paged_fields(slots, layers, row)
        else:
            fields, table, page, page_elems = _block_fields(slots, storage, kv_heads, head_dim)
            if any(getattr(s, "pieces", None) for s in slots):
                table, pieces = _piece_table(slots, storage, row)
        t = self.tuning
        blocks = _tiles(t, kv0.element_size())
        n = len(slots)
        q_lens = fields[4::FIELDS]
        n_tokens = sum(q_lens)
        n_decode = q_lens.count(1)
        n_tiles = sum(-(-q // blocks[1]) for q in q_lens if q > 1)
        longest = max((c + 1 for c, q in zip(fields[3::FIELDS], q_lens) if q == 1), default=0)
        # (a piece table's addresses: all but each row's first `pieces` entries, which are row numbers)
        addresses = [a for i in range(0, len(table), 4 * pieces) for a in table[i + pieces:i + 4 * pieces]] if pieces else ()
        divisor = math.gcd(row, head_dim, page_elems, *fields[0::FIELDS], *fields[1::FIELDS], *fields[2::FIELDS],
                           *addresses)
        width = len(table) // n
        # field-major on the host (each field a contiguous row: the kernels index them by request), each row padded
        # to an even length so that every field and the table start 16 bytes aligned: Triton specializes a kernel on
        # its pointers' alignment, and an odd batch compiled other variants inside a burst's steps
        m = (n | 1) + 1  # even, and past n whatever n is: the same ops for every batch (a step costs no op per request)
        columns = torch.zeros(FIELDS, m, dtype=torch.int64)
        columns[:, :n] = torch.tensor(fields, dtype=torch.int64).view(n, FIELDS).t()
        host = torch.cat([columns.flatten(), torch.tensor(table, dtype=torch.int64)])
        dev = self._to_device(host)
        base, lstride, half, starts, q_len = dev[:FIELDS * m].view(FIELDS, m)[:, :n]
        lens = starts + q_len
        ends = torch.cumsum(q_len, 0)
        q_rows = ends - q_len
        arange = torch.arange(max(n, n_tokens, n_tiles), device=self.device)
        tok_req = torch.repeat_interleave(arange[:n], q_len, output_size=n_tokens)
        tok_pos = arange[:n_tokens] - q_rows[tok_req] + starts[tok_req]
        dec_req = torch.argsort((q_len != 1).to(torch.int32), stable=True)[:n_decode]  # decoding requests first
        tiles = torch.where(q_len > 1, (q_len + blocks[1] - 1) // blocks[1], 0)
        tile_req = torch.repeat_interleave(arange[:n], tiles, output_size=n_tiles)
        tile_m = (arange[:n_tiles] - (torch.cumsum(tiles, 0) - tiles)[tile_req]) * blocks[1]
        step = TritonStep(
            kernels=self.kernels, storage=storage, row=row, head_dim=head_dim, page=page, page_elems=page_elems,
            table=dev[FIELDS * m:].view(n, width), table_stride=width, base=base, lstride=lstride, half=half,
            lens=lens, starts=starts, q_lens=q_len, q_rows=q_rows, tok_req=tok_req, tok_pos=tok_pos,
            n_tokens=n_tokens, dec_req=dec_req, dec_row=q_rows[dec_req], n_decode=n_decode, tile_req=tile_req,
            tile_m=tile_m, n_tiles=n_tiles, tuning=t, blocks=blocks,
            upcast=interpreting() and kv0.dtype == torch.bfloat16, picked=frozenset(range(n)),
            align=alignment(divisor, kv0.element_size()), rotary=rotary, last=ends - 1, pieces=pieces)
        step.choose_splits(longest, kv_heads)
        return step

    def static_decode(self, max_batch: int, storage: torch.Tensor, kv_heads: int, head_dim: int, *,
                      page: int = 0, page_elems: int = 0, table_width: int = 1,
                      rotary: torch.Tensor | None = None, pieces: int = 0) -> StaticDecode:
        """Decode steps of up to max_batch requests over buffers that never move (what a captured graph reads).
        pieces: every request's piece table has this many entries (0: none; contiguous blocks only)."""
        return StaticDecode(self, max_batch, storage, kv_heads, head_dim, page, page_elems, table_width, rotary,
                            pieces)


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
    align: int  # every row offset is a multiple of this many elements (the kernels' ALIGN hint)
    rotary: torch.Tensor | None  # the model's rotary table (Rotary.table): attend() rotates q and k itself
    last: torch.Tensor | None  # each request's last packed row (None: every row is one, a decode-only batch)
    rows: None = None
    split_min: int = 0
    n_splits: int = 1
    longest: int = 0  # the longest decoding context (eager plans; what split_tokens reports)
    pieces: int = 0  # entries of each request's piece table (`table`), 0: none (every request reads its own block)

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def rotates(self) -> bool:
        return self.rotary is not None

    @property
    def split_tokens(self) -> int:
        """The split length of the longest decoding request (shorter ones cut theirs shorter), as the kernel
        computes it."""
        tile = self.blocks[0]
        return max(self.split_min, -(-(-(-self.longest // self.n_splits)) // tile) * tile)

    def choose_splits(self, longest: int, kv_heads: int) -> None:
        """Decode splits: enough programs to fill the device (a batch of 1 at 16K still does), never a split
        shorter than one tile or `Tuning.split_tokens`; each request cuts its own context into n_splits (the
        kernel), so shorter ones get shorter splits, never more programs."""
        self.longest = longest
        if not self.n_decode:
            return
        self.split_min, self.n_splits = decode_splits(self.tuning, self.blocks[0], longest, self.n_decode, kv_heads)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads, dim], k/v [T, kv_heads, dim] of every packed token (before their rotary embedding when the
        step rotates): writes k, v into each request's block at its positions and returns the attention output
        [T, heads, dim] in the cache's dtype."""
        kern, t = self.kernels, self.tuning
        heads, dim = q.shape[1], q.shape[2]
        kv_dtype = self.storage.dtype
        q2, k2, v2 = _rows2d(q), _rows2d(k), _rows2d(v)
        if self.rotates:
            q_att = torch.empty(q.shape, dtype=kv_dtype, device=q.device)
        else:
            q_att = _rows2d(q.to(kv_dtype)).view(q.shape)
        out = torch.empty(q.shape, dtype=kv_dtype, device=q.device)
        addr = (self.base, self.lstride, self.half, self.table, self.table_stride, self.page_elems)
        kern.kv_write_kernel[(triton_cdiv(self.n_tokens, t.write_block_t),)](
            self.storage, q2, k2, v2, q_att, q2.stride(0), k2.stride(0), v2.stride(0), q_att.stride(0),
            self.rotary if self.rotates else self.lens, self.tok_req, self.tok_pos, self.n_tokens, *addr, layer,
            HEADS=heads, D=dim, HALF_B=_pow2(max(1, dim // 2)), ROW=self.row, BLOCK_T=t.write_block_t,
            BLOCK_R=_pow2(self.row), PAGE=self.page, ALIGN=self.align, ROTARY=self.rotates, PIECES=self.pieces)
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
                self.storage, q_att, out, acc, lse, q_att.stride(0), out.stride(0), self.dec_req, self.dec_row,
                self.lens, *addr[:5], self.page_elems, layer, scale, self.split_min, self.n_splits, HEADS=heads,
                GROUP=group, D=dim, ROW=self.row, BLOCK_G=max(16, _pow2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
                PAGE=self.page, SPLIT=split, UPCAST=self.upcast, ALIGN=self.align, PIECES=self.pieces)
            if split:
                kern.reduce_kernel[(self.n_decode, heads)](
                    out, acc, lse, self.dec_row, out.stride(0), self.n_splits, HEADS=heads, D=dim, BLOCK_D=block_d)
        if self.n_tiles:
            kern.prefill_kernel[(self.n_tiles, heads)](
                self.storage, q_att, out, q_att.stride(0), out.stride(0), self.tile_req, self.tile_m, self.q_rows,
                self.q_lens, self.starts, *addr[:5], self.page_elems, layer, scale, GROUP=group, D=dim,
                ROW=self.row, BLOCK_M=block_m, BLOCK_N=block_pn, BLOCK_D=block_d, PAGE=self.page,
                UPCAST=self.upcast, ALIGN=self.align, PIECES=self.pieces)
        return out


class StaticDecode:
    """Decode steps of 1..max_batch requests over device buffers allocated once: `fill` writes a step's requests
    into them (one copy from the host), `step(bucket)` is the plan of a batch padded to `bucket` requests, made once
    per bucket and valid for every later fill. Padding requests have no context (position -1: the write kernel
    skips them, attention returns zeros for them), so a captured bucket serves any batch up to its size.

    Buffers, int64 [FIELDS, max_batch]: each request's base, layer stride, K-to-V stride, position of the token fed
    (also its K/V row), context length after the step; the page table [max_batch, table_width] (paged only), or the
    piece tables [max_batch, 4 * pieces] (`pieces`: requests reading a shared prefix in place); the token ids fed
    [max_batch]."""

    def __init__(self, attention: TritonAttention, max_batch: int, storage: torch.Tensor, kv_heads: int,
                 head_dim: int, page: int, page_elems: int, table_width: int, rotary: torch.Tensor | None,
                 pieces: int = 0) -> None:
        if max_batch < 1:
            raise BackendError("a static decode batch needs room for at least one request")
        if pieces and (page or pieces < 2):
            raise BackendError("piece tables are for contiguous blocks, two entries or more")
        self.attention, self.max_batch, self.storage = attention, max_batch, storage
        self.kv_heads, self.head_dim, self.row = kv_heads, head_dim, kv_heads * head_dim
        self.pieces = pieces
        if pieces:
            table_width = 4 * pieces
        self.page, self.page_elems, self.table_width, self.rotary = page, page_elems, max(1, table_width), rotary
        device = attention.device
        b, width = max_batch, self.table_width if page or pieces else 0
        # one flat buffer on each side, one copy a step: fields [FIELDS, b], token ids [b], page table [b, width]
        size = (FIELDS + 1) * b + b * width
        pin = device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self._dev = torch.zeros(size, dtype=torch.int64, device=device)
        self.fields = self._dev[:FIELDS * b].view(FIELDS, b)
        self.token_ids = self._dev[FIELDS * b:(FIELDS + 1) * b]
        self.table = self._dev[(FIELDS + 1) * b:].view(b, width) if width else self._dev[:b].view(b, 1)
        self.rows = torch.arange(b, device=device)  # request i is packed row i, decoding
        self.ones = torch.ones(b, dtype=torch.int64, device=device)
        self._steps: dict[int, TritonStep] = {}
        # every row offset is a multiple of the layout's strides; each fill checks its blocks' offsets too
        self.divisor = math.gcd(self.row, head_dim, page_elems)
        self.align = alignment(self.divisor, storage.element_size())

    def fill(self, token_ids: Sequence[int], addresses: Sequence[tuple[int, int, int]], positions: Sequence[int],
             pages: Sequence[Sequence[int]] | None = None,
             pieces: Sequence[Sequence[tuple[int, int, int, int]]] | None = None) -> int:
        """Write a step's requests (token fed, block address (base, layer stride, K-to-V stride) in elements of the
        storage, position of the token) into the buffers, one copy to the device; returns the batch size. Rows past
        it become padding (none given: all of them, what a capture records). With piece tables, `pieces` gives each
        request's entries (the row after the piece, virtual base, layer stride, K-to-V stride), its own block last
        (`piece_entries`)."""
        n, b = len(token_ids), self.max_batch
        if not 0 <= n <= b or len(addresses) != n or len(positions) != n:
            raise BackendError(f"a static decode step takes up to {b} requests with one address and position each, "
                               f"got {n}")
        cols = torch.tensor([(*a, p, p + 1, tok) for a, p, tok in zip(addresses, positions, token_ids)],
                            dtype=torch.int64).view(n, FIELDS + 1)
        table = None
        if self.pieces:
            if pieces is None and n == 0:
                pieces = []
            if pieces is None or len(pieces) != n or any(not 0 < len(e) <= self.pieces for e in pieces):
                raise BackendError(f"a static decode step with piece tables needs every request's 1..{self.pieces} "
                                   "entries")
            table = [table_row(entries, self.pieces) for entries in pieces]
        addresses_of = cols[:, :3].flatten().tolist() + [a for row in table or () for a in row[self.pieces:]]
        if math.gcd(self.divisor, *addresses_of) % self.align:
            raise BackendError("a block is not aligned as the captured kernels assume")
        host = self._host
        fields = host[:FIELDS * b].view(FIELDS, b)
        fields.zero_()
        fields[3].fill_(-1)  # padding: no token to write, no context
        fields[:, :n] = cols[:, :FIELDS].t()
        host[FIELDS * b:FIELDS * b + n] = cols[:, FIELDS]
        if table is not None:
            rows = host[(FIELDS + 1) * b:].view(b, self.table_width)
            rows.zero_()
            if n:
                rows[:n] = torch.tensor(table, dtype=torch.int64)
        if self.page:
            if pages is None and n == 0:  # a batch of padding (what a capture records) has no pages to give
                pages = []
            if pages is None or len(pages) != n:
                raise BackendError("a paged static decode step needs every request's pages")
            table = host[(FIELDS + 1) * b:].view(b, self.table_width)
            table.zero_()
            for i, ids in enumerate(pages):
                if len(ids) > self.table_width:
                    raise BackendError(f"{len(ids)} pages do not fit a {self.table_width}-page table")
                table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
        self._dev.copy_(host, non_blocking=True)
        return n

    def step(self, bucket: int) -> TritonStep:
        """The plan of a decode step of `bucket` rows (the first `bucket` of the buffers)."""
        step = self._steps.get(bucket)
        if step is not None:
            return step
        if not 0 < bucket <= self.max_batch:
            raise BackendError(f"bucket {bucket} outside 1..{self.max_batch}")
        att, f, rows = self.attention, self.fields, self.rows[:bucket]
        t = att.tuning
        blocks = _tiles(t, self.storage.element_size())
        step = TritonStep(
            kernels=att.kernels, storage=self.storage, row=self.row, head_dim=self.head_dim, page=self.page,
            page_elems=self.page_elems, table=self.table[:bucket], table_stride=self.table_width,
            base=f[0, :bucket], lstride=f[1, :bucket], half=f[2, :bucket], lens=f[4, :bucket], starts=f[3, :bucket],
            q_lens=self.ones[:bucket], q_rows=rows, tok_req=rows,
            tok_pos=f[3, :bucket], n_tokens=bucket, dec_req=rows, dec_row=rows, n_decode=bucket, tile_req=rows[:0],
            tile_m=rows[:0], n_tiles=0, tuning=t, blocks=blocks,
            upcast=interpreting() and self.storage.dtype == torch.bfloat16, picked=frozenset(range(bucket)),
            align=self.align, rotary=self.rotary, last=None, pieces=self.pieces)
        # the splits are fixed per bucket (a graph replays its launches): enough programs to fill the device at
        # this batch; each request cuts its own context into them
        step.split_min = blocks[0]
        step.n_splits = max(1, min(t.max_splits, math.ceil(t.programs / (bucket * self.kv_heads))))
        self._steps[bucket] = step
        return step


def _block_fields(slots: Sequence, storage: torch.Tensor, kv_heads: int, head_dim: int):
    """Contiguous blocks: per request its element offset in `storage`, its per-layer and K-to-V strides, tokens
    cached and fed (flat, FIELDS per request); a one-column dummy table."""
    kv0, elem = slots[0].kv, storage.element_size()
    fields: list[int] = []
    for s in slots:
        kv = s.kv
        if kv.dtype != kv0.dtype or tuple(kv.shape[-2:]) != (kv_heads, head_dim) or not _rows_contiguous(kv):
            raise BackendError("blocks of one step must share dtype and head shape, rows contiguous")
        first = _own_first_row(s)
        if s.start + s.q_len - first > kv.shape[2]:
            raise BackendError(f"a block of {kv.shape[2]} tokens from row {first} cannot hold {s.start + s.q_len} tokens")
        offset = kv.data_ptr() - storage.data_ptr()  # blocks of other segments: relative to the first
        if offset % elem:
            raise BackendError("a block is not aligned to its elements")
        fields += (offset // elem, kv.stride(0), kv.stride(1), s.start, s.q_len)
    return fields, [0] * len(slots), 0, 0


PAST_ANY_ROW = 1 << 40  # a piece table's end for the request's own block (and the padding after it)


def _own_first_row(slot) -> int:
    """The first row a slot's own block holds: after the pieces it reads from other blocks (0 without)."""
    pieces = getattr(slot, "pieces", None)
    return pieces[-1][2] if pieces else 0


def piece_entries(pieces: Sequence[tuple[tuple[int, int, int], int, int]], own: tuple[int, int, int], own_first: int,
                  row: int) -> list[tuple[int, int, int, int]]:
    """A request's piece table entries (the row after the piece, virtual base, layer stride, K-to-V stride), its own
    block last, from each block's address (base, layer stride, K-to-V stride; elements of the storage), the first
    row it holds and the row after the piece."""
    return [(end, base - first * row, lstride, half) for (base, lstride, half), first, end in
            [*pieces, (own, own_first, PAST_ANY_ROW)]]


def _piece_table(slots: Sequence, storage: torch.Tensor, row: int) -> tuple[list[int], int]:
    """Every request's piece table (`triton_kernels`, PIECES): a request that reads its first rows from other blocks
    (`pieces`: (block view, the first row it holds, the row after the piece) in row order) has one entry per piece
    and one for its own block, the others one; PIECES is the longest, to a power of two (few kernel variants)."""
    elem = storage.element_size()
    rows_of = []
    for s in slots:
        addressed, previous = [], 0
        for view, first, end in [*(getattr(s, "pieces", None) or ()), (s.kv, _own_first_row(s), PAST_ANY_ROW)]:
            if view.dtype != storage.dtype or not _rows_contiguous(view) or not first <= previous < end:
                raise BackendError(f"a piece of rows {previous}..{end} from a block that holds rows from {first}")
            if end != PAST_ANY_ROW and end - first > view.shape[2]:
                raise BackendError(f"a block of {view.shape[2]} rows from row {first} cannot hold rows to {end}")
            offset = view.data_ptr() - storage.data_ptr()
            if offset % elem:
                raise BackendError("a block is not aligned to its elements")
            addressed.append(((offset // elem, view.stride(0), view.stride(1)), first, end))
            previous = end
        *pieces, (own, own_first, _) = addressed
        rows_of.append(piece_entries(pieces, own, own_first, row))
    pieces = _pow2(max(len(e) for e in rows_of))
    return [x for entries in rows_of for x in table_row(entries, pieces)], pieces


def table_row(entries: Sequence[tuple[int, int, int, int]], pieces: int) -> list[int]:
    """One request's piece table row: its entries padded with its own block's to `pieces` (past the own block, never
    chosen: its end is past every row), field-major: ends, virtual bases, layer strides, K-to-V strides."""
    entries = list(entries) + [entries[-1]] * (pieces - len(entries))
    return [e[i] for i in range(4) for e in entries]


def _paged_fields(slots: Sequence, layers: int, row: int):
    """Pages (blocks of PAGE tokens): the page's strides for every request, and every request's page table padded
    to the longest."""
    page = slots[0].kv.shape[-3]
    width = max(max(len(s.pages) for s in slots), 1)
    fields: list[int] = []
    table: list[int] = []
    for s in slots:
        if len(s.pages) * page < s.start + s.q_len:
            raise BackendError(f"{len(s.pages)} pages of {page} tokens cannot hold {s.start + s.q_len} tokens")
        fields += (0, 2 * page * row, page * row, s.start, s.q_len)
        table += list(s.pages) + [0] * (width - len(s.pages))
    return fields, table, page, page * layers * 2 * row


def decode_splits(t: Tuning, tile: int, longest: int, n_decode: int, kv_heads: int) -> tuple[int, int]:
    """(split_min, n_splits) of a decode launch: enough programs to fill the device (a batch of 1 at 16K still
    does), never a split shorter than one tile or `Tuning.split_tokens`."""
    if t.split_tokens is not None:
        split_min = max(t.split_tokens, 1)
        wanted = -(-longest // split_min)
    else:
        split_min = tile
        wanted = min(math.ceil(t.programs / (n_decode * kv_heads)), -(-longest // tile))
    return split_min, max(1, min(wanted, t.max_splits))


def _tiles(t: Tuning, element_size: int) -> tuple[int, int, int]:
    """(decode key tile, prefill query tile, prefill key tile): fp32 tiles hold twice the bytes, so they are halved
    (at most 32) to keep pipelined K/V tiles within a multiprocessor's shared memory."""
    if element_size >= 4:
        return min(t.decode_block_n, 32), min(t.prefill_block_m, 32), min(t.prefill_block_n, 32)
    return t.decode_block_n, t.prefill_block_m, t.prefill_block_n


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rows2d(x: torch.Tensor) -> torch.Tensor:
    """[T, heads, dim] with each token's heads packed → [T, heads * dim] (a view when it can be)."""
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
