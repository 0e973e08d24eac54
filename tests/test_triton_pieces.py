"""The Triton kernels reading a request's first rows from other requests' blocks (a table of pieces: the design for a
shared prompt prefix held once in contiguous memory, docs/results/gpu/replay_policy.md): decode, prefill chunks and
the K/V write agree with float64 attention over the same rows laid out in one block, beside requests that read only
their own; the write touches nothing but the requests' own blocks. Runs on a GPU, or on CPU under Triton's
interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backends import triton_attention
from backends.errors import BackendError
from backends.triton_attention import TritonAttention, Tuning

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not triton_attention.interpreting() else "cpu")
pytestmark = pytest.mark.skipif(triton_attention.available(DEVICE) is not None,
                                reason=f"Triton cannot run here: {triton_attention.available(DEVICE)}")

LAYERS, KV_HEADS, GROUP, DIM = 2, 2, 3, 64
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


class Arena:
    """Blocks laid out one after another (a gap of one row between them) in one flat tensor of random K/V."""

    def __init__(self, caps: dict[str, int], dtype: torch.dtype, seed: int = 0) -> None:
        self.per_row = LAYERS * 2 * KV_HEADS * DIM
        self.at, pos = {}, 0
        for name, cap in caps.items():
            self.at[name] = (pos, cap)
            pos += cap + 1
        gen = torch.Generator().manual_seed(seed)
        self.flat = torch.randn(pos * self.per_row, generator=gen).to(dtype).to(DEVICE)

    def view(self, name: str, flat: torch.Tensor | None = None) -> torch.Tensor:
        pos, cap = self.at[name]
        flat = self.flat if flat is None else flat
        return flat[pos * self.per_row:(pos + cap) * self.per_row].view(LAYERS, 2, cap, KV_HEADS, DIM)


def _slot(arena: Arena, own: str, start: int, q_len: int, pieces=(), flat=None):
    """A request of the step: its own block `own` (holding rows from the end of its pieces), `pieces` as (block,
    the first row that block holds, the row after the piece)."""
    views = [(arena.view(name, flat), first, end) for name, first, end in pieces]
    return SimpleNamespace(kv=arena.view(own, flat), pages=None, start=start, q_len=q_len, pieces=views or None)


def _rows(slot, layer: int) -> torch.Tensor:
    """The request's rows of `layer` in order, [n, 2, kv_heads, dim]: each piece's from its block, then its own."""
    parts, previous = [], 0
    for view, first, end in slot.pieces or ():
        parts.append(view[layer, :, previous - first:end - first])
        previous = end
    parts.append(slot.kv[layer, :, : slot.start + slot.q_len - previous])
    return torch.cat(parts, dim=1).transpose(0, 1)


def _reference(slots, q, k, v):
    """The step's K/V written into each own block (rows from its first), then float64 causal attention over every
    request's rows."""
    pos = 0
    for s in slots:
        first = s.pieces[-1][2] if s.pieces else 0
        s.kv[1, 0, s.start - first:s.start - first + s.q_len] = k[pos:pos + s.q_len]
        s.kv[1, 1, s.start - first:s.start - first + s.q_len] = v[pos:pos + s.q_len]
        pos += s.q_len
    out = torch.empty(q.shape, dtype=torch.float64)
    pos = 0
    for s in slots:
        n = s.start + s.q_len
        rows = _rows(s, 1).double().cpu()
        keys, vals = (rows[:, i].repeat_interleave(GROUP, dim=1) for i in (0, 1))
        scores = torch.einsum("qhd,khd->hqk", q[pos:pos + s.q_len].double().cpu(), keys) / DIM ** 0.5
        mask = torch.arange(n)[None, :] <= (torch.arange(s.q_len)[:, None] + s.start)
        out[pos:pos + s.q_len] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1),
                                              vals)
        pos += s.q_len
    return out


# blocks: holder H (rows from 0), G (rows from 16: it read its first 16 from H), readers' own blocks, a plain one
CAPS = {"H": 48, "G": 40, "R": 24, "S": 32, "T": 40, "P": 20}
# (own block, cached, fed, pieces): R decodes at 45 reading 0..16 from H and 16..40 from G; S prefills a chunk at 40
# over the same pieces (what a request admitted to read them computes first); T reads 0..16 from H and prefills its
# own from 16; H and P read only their own blocks
STEP = [("H", 30, 1, ()), ("R", 45, 1, (("H", 0, 16), ("G", 16, 40))), ("S", 40, 9, (("H", 0, 16), ("G", 16, 40))),
        ("T", 16, 20, (("H", 0, 16),)), ("P", 0, 7, ())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_requests_read_their_first_rows_from_other_blocks(dtype):
    arena = Arena(CAPS, dtype)
    expected_flat = arena.flat.clone()
    slots = [_slot(arena, own, start, q_len, pieces) for own, start, q_len, pieces in STEP]
    expected = [_slot(arena, own, start, q_len, pieces, expected_flat) for own, start, q_len, pieces in STEP]
    t = sum(q_len for _, _, q_len, _ in STEP)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(t, heads, DIM, generator=gen).to(dtype).to(DEVICE)
               for heads in (KV_HEADS * GROUP, KV_HEADS, KV_HEADS))
    ref = _reference(expected, q, k, v)
    step = TritonAttention(DEVICE, Tuning(split_tokens=16)).plan_step(slots)
    assert step.pieces == 4  # R and S read two pieces and their own block: three entries, to a power of two
    out = step.attend(1, q, k, v).cpu()
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL[dtype] * ref.abs().max().item(), err
    assert torch.equal(arena.flat, expected_flat), "the write touched rows it should not (or missed one)"


def test_a_step_without_pieces_plans_as_before():
    arena = Arena(CAPS, torch.float32)
    step = TritonAttention(DEVICE).plan_step([_slot(arena, "H", 30, 1), _slot(arena, "P", 0, 7)])
    assert step.pieces == 0


@pytest.mark.parametrize("start, pieces, why", [
    (20, (("H", 8, 16),), "holds rows from 8"),  # the piece's block does not hold its first rows
    (61, (("H", 0, 60),), "cannot hold rows to 60"),  # past the holder's block
    (20, (("H", 0, 16), ("G", 16, 10)), "rows 16..10"),  # out of order
    (45, (("H", 0, 16),), "from row 16 cannot hold 46"),  # past the reader's own block
])
def test_a_piece_the_blocks_do_not_hold_is_refused(start, pieces, why):
    arena = Arena(CAPS, torch.float32)
    with pytest.raises(BackendError, match=why):
        TritonAttention(DEVICE).plan_step([_slot(arena, "R", start, 1, pieces)])
