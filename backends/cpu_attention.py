"""The CPU backend's decode-attention kernel (csrc/decode_attention.c), built on first use and called by ctypes.

Why: torch's SDPA costs ~60 us of fixed overhead per call and, for one query token, reads a request's K/V
several times over, so a decode step of 32 requests x 30 layers spent more time in 960 SDPA calls than in
the weights. The kernel handles all decoding requests of a layer in one call and streams each block's K and
V once, in order (`odma-bench step` compares). A request that reads its first rows from other blocks (a prefix read
in place, a block continued elsewhere: `PieceTables`) is read piece by piece, each streamed in place, with the same
sums as one block holding those rows. Prefill chunks still use SDPA. With several torch threads the
requests are split into that many shares of about equal context, run from a thread pool (ctypes releases the
GIL), so the kernel uses the cores the GEMMs use.

The library is compiled with the system C compiler for this CPU (`ckernels.py`). No compiler, a failed build,
or ODMA_CPU_KERNELS=0: `load()` returns None (logged once) and the model falls back to SDPA.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from backends import ckernels

SOURCE = ckernels.CSRC / "decode_attention.c"
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC")
PORTABLE_FLAGS = ("-O3", "-ffast-math", "-fPIC")  # where the compiler has no -march=native
_P, _I = ctypes.c_void_p, ctypes.c_int64
KV_DTYPES = (torch.float32, torch.float16)  # the caches the kernel reads (fp16: half the bytes a step streams)


@dataclass(slots=True)
class DecodeBatch:
    """The decoding requests of one step, as the kernel sees them (built once per step, used by every layer)."""

    kernel: DecodeAttention
    picked: frozenset[int]  # indices (in the step's request order) of the requests planned here
    rows: torch.Tensor | None  # positions of these requests' tokens in the packed step; None: all of them
    blocks: torch.Tensor  # int64 [B]: address of each block
    layer_stride: torch.Tensor  # int64 [B]: elements between layers in each block
    half_stride: torch.Tensor  # int64 [B]: elements from K to V of a layer
    lens: torch.Tensor  # int64 [B]: context length including this step's token
    shares: list[tuple[int, int]]  # [lo, hi) ranges of the B requests, one per worker thread
    half: bool = False  # the blocks hold fp16 K/V (else fp32)
    # requests that read their first rows from other blocks (`SeqSlot.pieces`); None: none does
    pieces: PieceTables | None = None

    rotates = False  # the model rotates q and k before the kernel sees them
    kv_dtype = torch.float32  # what q, k, v are handed in as: the kernel's arithmetic is fp32 for either cache dtype

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.kernel(self, layer, q, k, v)


@dataclass(slots=True)
class PieceTables:
    """The pieces each planned request reads before its own block, as the kernel takes them: request b's are entries
    start[b]:start[b + 1] of the other tensors (int64), in row order; its own block holds rows from own_first[b]."""

    start: torch.Tensor  # [B + 1]
    blocks: torch.Tensor  # address of each piece's block
    layer_stride: torch.Tensor
    half_stride: torch.Tensor
    first: torch.Tensor  # the first row each piece's block holds
    end: torch.Tensor  # the row after the piece
    own_first: torch.Tensor  # [B]

    @classmethod
    def of(cls, pieces: list) -> PieceTables | None:
        """Each request's pieces (a list of (block view, first row, row after), or None); None when none has any."""
        if not any(pieces):
            return None
        start, rows = [0], []
        for own in pieces:
            rows += [(view.data_ptr(), view.stride(0), view.stride(1), first, end) for view, first, end in own or ()]
            start.append(len(rows))
        columns = list(zip(*rows))
        return cls(*(torch.tensor(x, dtype=torch.long) for x in (start, *columns, [_own_first(p) for p in pieces])))



MAX_PIECES = 16  # pieces the kernels read for one request (attend.h's MAX_PIECES); a request with more is not planned


def piece_pointers(pieces: PieceTables | None, lo: int = 0) -> tuple[int | None, ...]:
    """The kernels' piece arguments (attend.h's `odma_pieces`, field by field) for the requests from `lo` on (their
    entries stay where they are); NULLs without pieces."""
    if pieces is None:
        return (None,) * 7
    i64 = 8
    return (pieces.start.data_ptr() + lo * i64, pieces.blocks.data_ptr(), pieces.layer_stride.data_ptr(),
            pieces.half_stride.data_ptr(), pieces.first.data_ptr(), pieces.end.data_ptr(),
            pieces.own_first.data_ptr() + lo * i64)


class DecodeAttention:
    """Decode attention straight from contiguous fp32 or fp16 blocks; see the module docstring."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.odma_decode_attention
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_P, _P, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_float, _I] + [_P] * 7
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    def plan_step(self, slots) -> DecodeBatch | None:
        """`plan` for a model step's slots (each with `kv`, `start`, `q_len`, and `pieces` where it reads rows from
        other blocks; paged slots are not for this kernel)."""
        if any(s.pages is not None for s in slots):
            return None
        return self.plan([s.kv for s in slots], [s.start for s in slots], [s.q_len for s in slots],
                         pieces=[getattr(s, "pieces", None) for s in slots])

    def plan(self, blocks: list[torch.Tensor], starts: list[int], q_lens: list[int],
             workers: int | None = None, pieces: list | None = None) -> DecodeBatch | None:
        """The requests with q_len 1 whose blocks the kernel can read (fp32 or fp16, rows contiguous); None if none.
        workers: threads to split them over (default: torch's thread count). pieces: each request's pieces (a list
        of (block view, first row, row after), or None), read before its own block, which then holds rows from the
        last piece's end."""
        pieces = pieces or [None] * len(blocks)
        # start < capacity: the kernel writes row `start` of the block, and must never write past it
        picked = [i for i, (kv, start, n, own) in enumerate(zip(blocks, starts, q_lens, pieces))
                  if n == 1 and _readable(kv) and start - _own_first(own) < kv.shape[2]
                  and len(own or ()) <= MAX_PIECES and all(_readable(view) for view, _, _ in own or ())]
        if not picked:
            return None
        rows = None
        if len(picked) < len(blocks):
            offsets = [0]
            for n in q_lens:
                offsets.append(offsets[-1] + n)
            rows = torch.tensor([offsets[i] for i in picked], dtype=torch.long)
        half = _half([blocks[i] for i in picked] + [view for i in picked for view, _, _ in pieces[i] or ()])
        lens = [starts[i] + 1 for i in picked]
        return DecodeBatch(
            kernel=self, picked=frozenset(picked), rows=rows,
            blocks=torch.tensor([blocks[i].data_ptr() for i in picked], dtype=torch.long),
            layer_stride=torch.tensor([blocks[i].stride(0) for i in picked], dtype=torch.long),
            half_stride=torch.tensor([blocks[i].stride(1) for i in picked], dtype=torch.long),
            lens=torch.tensor(lens, dtype=torch.long),
            shares=_shares(lens, workers or torch.get_num_threads()),
            half=half,
            pieces=PieceTables.of([pieces[i] for i in picked]),
        )

    def plan_tokens(self, slots) -> DecodeBatch | None:
        """Every token row of a step as a row of its own, for the decode-step kernel (backends/cpu_step.py): a prefill
        chunk's rows share their request's block, each over its causal prefix (lens start + 1 .. start + q_len); the
        kernel writes every row's k and v before any row attends. None where a block is paged or unreadable, or a
        chunk would pass its block's capacity. Not for `__call__`, which takes one row per request."""
        if any(s.pages is not None or getattr(s, "pieces", None) or not _readable(s.kv)
               or s.start + s.q_len > s.kv.shape[2] for s in slots):
            return None
        half = _half([s.kv for s in slots])
        lens = [n for s in slots for n in range(s.start + 1, s.start + s.q_len + 1)]

        def per_row(value) -> torch.Tensor:
            return torch.tensor([value(s) for s in slots for _ in range(s.q_len)], dtype=torch.long)

        return DecodeBatch(
            kernel=self, picked=frozenset(range(len(slots))), rows=None,
            blocks=per_row(lambda s: s.kv.data_ptr()), layer_stride=per_row(lambda s: s.kv.stride(0)),
            half_stride=per_row(lambda s: s.kv.stride(1)), lens=torch.tensor(lens, dtype=torch.long),
            shares=[(0, len(lens))], half=half,
        )

    def __call__(self, batch: DecodeBatch, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, heads, dim], k/v [B, kv_heads, dim] (fp32) for the planned requests; writes k, v into the
        blocks at row lens-1 and returns the attention output [B, heads, dim]."""
        q, k, v = (x.contiguous() for x in (q, k, v))
        b, heads, dim = q.shape
        out = torch.empty_like(q)
        kv_heads, scale = k.shape[1], dim ** -0.5

        def run(lo: int, hi: int) -> int:
            i64, f32 = 8, 4  # byte sizes of the index arrays' and the activations' elements
            return self._fn(batch.blocks.data_ptr() + lo * i64, batch.layer_stride.data_ptr() + lo * i64,
                            batch.half_stride.data_ptr() + lo * i64, layer, batch.lens.data_ptr() + lo * i64,
                            q.data_ptr() + lo * heads * dim * f32, k.data_ptr() + lo * kv_heads * dim * f32,
                            v.data_ptr() + lo * kv_heads * dim * f32, out.data_ptr() + lo * heads * dim * f32,
                            hi - lo, heads, kv_heads, dim, scale, int(batch.half),
                            *piece_pointers(batch.pieces, lo))

        if len(batch.shares) == 1:
            codes = [run(0, b)]
        else:
            if self._pool_size < len(batch.shares):
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(len(batch.shares), thread_name_prefix="odma-attn")
                self._pool_size = len(batch.shares)
            codes = list(self._pool.map(lambda share: run(*share), batch.shares))
        if any(codes):
            raise RuntimeError(f"decode attention kernel failed (codes {codes})")
        return out


def _shares(lens: list[int], workers: int) -> list[tuple[int, int]]:
    """Split requests into at most `workers` consecutive ranges of about equal total context."""
    prefix = [0]
    for n in lens:
        prefix.append(prefix[-1] + n)
    cuts = {0, len(lens)}
    for k in range(1, max(1, min(workers, len(lens)))):
        target = prefix[-1] * k / workers
        cuts.add(min(range(len(prefix)), key=lambda i: abs(prefix[i] - target)))
    bounds = sorted(cuts)
    return list(zip(bounds[:-1], bounds[1:]))


def _own_first(pieces) -> int:
    """The first row a request's own block holds: the end of the last piece it reads (0 without)."""
    return pieces[-1][2] if pieces else 0


def _half(blocks: list[torch.Tensor]) -> bool:
    """Whether a step's blocks hold fp16 K/V (else fp32); they share one dtype, as one arena has one."""
    dtypes = {kv.dtype for kv in blocks}
    if len(dtypes) > 1:
        raise ValueError(f"one step's blocks in several dtypes ({sorted(map(str, dtypes))}): one arena has one")
    return dtypes == {torch.float16}


def _readable(kv: torch.Tensor) -> bool:
    """A block view [layers, 2, capacity, kv_heads, head_dim] in fp32 or fp16 on the CPU whose rows are contiguous."""
    if kv.dtype not in KV_DTYPES or kv.device.type != "cpu" or kv.dim() != 5:
        return False
    _, _, _, heads, dim = kv.shape
    return kv.stride(4) == 1 and kv.stride(3) == dim and kv.stride(2) == heads * dim


# the kernel, built on first use; None where it cannot be
load: ckernels.Loader[DecodeAttention] = ckernels.Loader(
    SOURCE, (FLAGS, PORTABLE_FLAGS), DecodeAttention, "CPU decode-attention kernel",
    "decode attention falls back to SDPA", link=("-lm",))
