"""The Triton attention kernels compute what causal SDPA computes, over contiguous blocks and through page tables.

Without a GPU they run in Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1 when no
CUDA device is visible); with one (scripts/gpu_check.sh) the same tests run compiled on it. The reference is
float64 attention over the same rounded K/V, plus the CPU backend's C decode kernel where it applies (fp32).
Shapes are small (the interpreter is slow) but cover what the kernels branch on: ragged lengths 1, 2 and 17,
blocks at the arena's first and last slot, contexts longer than a decode split, GQA groups 1/3/7, head_dim 64 and
128, fp32/fp16/bf16, prefill chunks after cached tokens, and a decode and prefill mix in one step.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from backends import triton_attention  # noqa: E402
from backends.triton_attention import TritonAttention, Tuning  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not triton_attention.interpreting() else "cpu")
pytestmark = pytest.mark.skipif(triton_attention.available(DEVICE) is not None,
                                reason=f"Triton cannot run here: {triton_attention.available(DEVICE)}")

LAYERS = 2
PAGE = 16
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # relative to the largest output


def _step(shapes: list[tuple[int, int]], *, kv_heads: int, group: int, dim: int, dtype: torch.dtype, paged: bool,
          seed: int = 0):
    """An arena holding one request per (cached, q_len) pair, with random K/V already cached, and that step's
    q/k/v. Contiguous blocks are packed with gaps, the first at slot 0 and the last ending at the arena's end;
    pages are scattered. Returns (arena, slots, q, k, v, reader) where reader(arena, i) gives request i's [n, 2,
    kv_heads, dim] K/V rows of layer 1."""
    gen = torch.Generator().manual_seed(seed)
    row = kv_heads * dim
    per_token = LAYERS * 2 * row
    lens = [c + q for c, q in shapes]
    if paged:
        counts = [-(-n // PAGE) for n in lens]
        total_pages = sum(counts) + 3
        order = list(range(total_pages))
        random.Random(seed).shuffle(order)
        # page 0 and the last page are in use: the table reaches the arena's ends
        order.remove(0), order.remove(total_pages - 1)
        order = [0, total_pages - 1] + order
        arena = torch.randn(total_pages * PAGE * per_token, generator=gen).to(dtype)
        pages_view = arena.view(total_pages, LAYERS, 2, PAGE, kv_heads, dim)
        slots, used = [], 0
        for (cached, q_len), n in zip(shapes, counts):
            slots.append(SimpleNamespace(kv=pages_view, pages=order[used:used + n], start=cached, q_len=q_len))
            used += n

        def reader(a: torch.Tensor, i: int) -> torch.Tensor:
            s = slots[i]
            pv = a.view(total_pages, LAYERS, 2, PAGE, kv_heads, dim)
            rows = torch.cat([pv[p, 1] for p in s.pages], dim=1)  # [2, pages * PAGE, kv_heads, dim]
            return rows[:, : s.start + s.q_len].transpose(0, 1)
    else:
        caps = [max(1, n + (3 if i % 2 else 0)) for i, n in enumerate(lens)]  # some blocks exactly full
        gaps = [0] + [2] * (len(caps) - 1)
        offsets, at = [], 0
        for cap, gap in zip(caps, gaps):
            at += gap
            offsets.append(at)
            at += cap
        arena = torch.randn(at * per_token, generator=gen).to(dtype)
        slots = [SimpleNamespace(kv=arena[o * per_token:(o + c) * per_token].view(LAYERS, 2, c, kv_heads, dim),
                                 pages=None, start=cached, q_len=q_len)
                 for o, c, (cached, q_len) in zip(offsets, caps, shapes)]

        def reader(a: torch.Tensor, i: int) -> torch.Tensor:
            o, c, s = offsets[i], caps[i], slots[i]
            block = a[o * per_token:(o + c) * per_token].view(LAYERS, 2, c, kv_heads, dim)
            return block[1, :, : s.start + s.q_len].transpose(0, 1)
    t = sum(q for _, q in shapes)
    q = torch.randn(t, kv_heads * group, dim, generator=gen).to(dtype)
    k = torch.randn(t, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(t, kv_heads, dim, generator=gen).to(dtype)
    return arena, slots, q, k, v, reader


def _reference(arena, slots, q, k, v, reader):
    """Writes the step's K/V into a copy of the arena with plain indexing, then float64 causal attention."""
    out = torch.empty(q.shape, dtype=torch.float64)
    expected = arena.clone()
    pos = 0
    views = []
    for i, s in enumerate(slots):  # first every write, as the kernels do, then the reads
        rows = reader(expected, i)  # a view into `expected` for contiguous blocks; a copy for pages
        rows[s.start:s.start + s.q_len, 0] = k[pos:pos + s.q_len]
        rows[s.start:s.start + s.q_len, 1] = v[pos:pos + s.q_len]
        if s.pages is not None:  # write the copy back, page by page
            pv = expected.view(-1, *s.kv.shape[1:])
            for j, p in enumerate(s.pages):
                chunk = rows[j * PAGE:(j + 1) * PAGE]
                pv[p, 1, :, : len(chunk)] = chunk.transpose(0, 1)
        views.append(rows.clone())
        pos += s.q_len
    group = q.shape[1] // k.shape[1]
    pos = 0
    for s, rows in zip(slots, views):
        n = s.start + s.q_len
        keys = rows[:n, 0].double().repeat_interleave(group, dim=1)  # [n, heads, dim]
        vals = rows[:n, 1].double().repeat_interleave(group, dim=1)
        qs = q[pos:pos + s.q_len].double()
        scores = torch.einsum("qhd,khd->hqk", qs, keys) / q.shape[2] ** 0.5
        mask = torch.arange(n)[None, :] <= (torch.arange(s.q_len)[:, None] + s.start)
        scores = scores.masked_fill(~mask, float("-inf"))
        out[pos:pos + s.q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)
        pos += s.q_len
    return out, expected


def _run(arena, slots, q, k, v, tuning: Tuning | None = None):
    dev = [a.to(DEVICE) for a in (arena, q, k, v)]
    arena_d = dev[0]
    if slots[0].pages is not None:
        shape = slots[0].kv.shape
        moved = [SimpleNamespace(kv=arena_d.view(shape), pages=s.pages, start=s.start, q_len=s.q_len) for s in slots]
    else:
        moved = []
        for s in slots:
            at = s.kv.storage_offset()
            moved.append(SimpleNamespace(kv=arena_d[at:at + s.kv.numel()].view(s.kv.shape), pages=None, start=s.start,
                                         q_len=s.q_len))
    step = TritonAttention(DEVICE, tuning).plan_step(moved)
    out = step.attend(1, *dev[1:])
    return out.cpu(), arena_d.cpu(), step


def _check(out, ref, dtype):
    err = (out.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} > {TOL[dtype]} x {scale:.3g}"


# (cached tokens, tokens fed): decodes of contexts 1, 2, 17 and 40 (longer than a 16-token split), a prompt prefilled
# from 0, and a chunk after 9 cached tokens (a copied prefix or an earlier chunk)
MIX = [(0, 1), (1, 1), (16, 1), (39, 1), (0, 17), (9, 8)]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (1, 3), (2, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_a_mixed_step_matches_the_reference(paged, kv_heads, group, dtype):
    case = _step(MIX, kv_heads=kv_heads, group=group, dim=64, dtype=dtype, paged=paged)
    ref, expected = _reference(*case)
    out, arena_after, step = _run(*case[:5], Tuning(split_tokens=16))
    assert step.n_splits == 3  # the 40-token context is split
    _check(out, ref, dtype)
    assert torch.equal(arena_after, expected), "the write touched rows it should not (or missed one)"


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_an_odd_batch_reads_aligned_index_rows(paged):
    """Triton specializes a kernel on its pointers' 16-byte alignment: the plan's per-request rows and page table
    start aligned whatever the batch size, so an odd batch compiles no other variant (one did inside the bursts)."""
    case = _step(MIX[:5], kv_heads=2, group=1, dim=64, dtype=torch.float32, paged=paged)
    ref, expected = _reference(*case)
    out, arena_after, step = _run(*case[:5], Tuning(split_tokens=16))
    for name in ("base", "lstride", "half", "starts", "q_lens", "table"):
        assert getattr(step, name).data_ptr() % 16 == 0, name
    _check(out, ref, torch.float32)
    assert torch.equal(arena_after, expected)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_head_dim_128_and_the_automatic_split(paged, dtype):
    case = _step([(0, 1), (1, 1), (16, 1), (70, 1), (0, 2)], kv_heads=2, group=3, dim=128, dtype=dtype, paged=paged)
    ref, expected = _reference(*case)
    out, arena_after, step = _run(*case[:5], Tuning(programs=48, decode_block_n=16))
    assert step.n_splits > 1 and step.split_tokens % 16 == 0
    _check(out, ref, dtype)
    assert torch.equal(arena_after, expected)


@pytest.mark.parametrize("paged,dtype", [(False, torch.float32), (False, torch.bfloat16), (True, torch.bfloat16)],
                         ids=["contiguous-fp32", "contiguous-bf16", "paged-bf16"])
def test_long_contexts_and_prefills_of_several_tiles_in_one_ragged_step(paged, dtype):
    """Decodes at 4K and 16K contexts, split as the device's program count has it (no split length forced), beside
    a short decode, a 150-token prompt (3 to 5 query tiles) and a 70-token chunk after 100 cached tokens."""
    shapes = [(4095, 1), (16383, 1), (5, 1), (0, 150), (100, 70)]
    case = _step(shapes, kv_heads=2, group=3, dim=64, dtype=dtype, paged=paged)
    ref, expected = _reference(*case)
    out, arena_after, step = _run(*case[:5])
    assert step.n_splits > 1 and step.n_tiles >= 3 + 2  # natural splits; the prompt and the chunk tiled
    _check(out, ref, dtype)
    assert torch.equal(arena_after, expected)


def test_one_request_at_a_long_context_fills_the_device_with_splits():
    """A batch of 1: the split count follows the program target, capped, and every split's share is combined."""
    case = _step([(299, 1)], kv_heads=1, group=2, dim=64, dtype=torch.float32, paged=False)
    ref, _ = _reference(*case)
    out, _, step = _run(*case[:5], Tuning(programs=64, decode_block_n=16, max_splits=8))
    assert step.n_splits == 8  # 64 programs wanted from 1 request x 1 kv head, capped at 8
    _check(out, ref, torch.float32)


def test_a_single_token_block_at_the_arenas_last_slot():
    """A one-token prompt decoding its first token, its block the arena's very last slot."""
    case = _step([(3, 1), (0, 1)], kv_heads=2, group=2, dim=64, dtype=torch.float32, paged=False)
    arena, slots = case[0], case[1]
    assert slots[-1].kv.data_ptr() + slots[-1].kv.numel() * 4 == arena.data_ptr() + arena.numel() * 4
    ref, expected = _reference(*case)
    out, arena_after, _ = _run(*case[:5])
    _check(out, ref, torch.float32)
    assert torch.equal(arena_after, expected)


def test_blocks_of_separate_allocations_are_read_through_one_base():
    """Ballooned segments are separate tensors: their blocks are addressed relative to the first one's storage."""
    case = _step([(5, 1), (12, 1), (0, 9)], kv_heads=2, group=2, dim=64, dtype=torch.float32, paged=False)
    arena, slots, q, k, v, _ = case
    segments = [s.kv.clone().to(DEVICE) for s in slots]  # each block now its own allocation
    moved = [SimpleNamespace(kv=seg, pages=None, start=s.start, q_len=s.q_len) for seg, s in zip(segments, slots)]
    out = TritonAttention(DEVICE).plan_step(moved).attend(1, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)).cpu()
    ref, _ = _reference(*case)
    _check(out, ref, torch.float32)
    pos = 0
    for seg, s in zip(segments, moved):
        assert torch.equal(seg[1, 0, s.start:s.start + s.q_len].cpu(), k[pos:pos + s.q_len])
        pos += s.q_len


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the C kernel is the CPU backend's")
def test_decode_agrees_with_the_cpu_backends_kernel():
    from backends import get_backend

    kernel = get_backend("cpu").decode_attention()
    if kernel is None:
        pytest.skip("no C compiler for the CPU kernel")
    shapes = [(0, 1), (1, 1), (16, 1), (40, 1)]
    case = _step(shapes, kv_heads=2, group=3, dim=64, dtype=torch.float32, paged=False)
    arena, slots, q, k, v, _ = case
    twin = arena.clone()
    per_token = LAYERS * 2 * 2 * 64
    blocks = [twin[s.kv.storage_offset():s.kv.storage_offset() + s.kv.numel()].view(s.kv.shape) for s in slots]
    del per_token
    c_out = kernel.plan(blocks, [s.start for s in slots], [1] * len(slots), workers=1).attend(1, q, k, v)
    out, arena_after, _ = _run(arena, slots, q, k, v, Tuning(split_tokens=16))
    torch.testing.assert_close(out, c_out, rtol=1e-5, atol=1e-5 * c_out.abs().max().item())
    assert torch.equal(arena_after, twin)


def test_plans_refuse_what_the_kernels_cannot_read():
    from backends.errors import BackendError

    arena, slots, *_ = _step([(4, 1), (2, 1)], kv_heads=2, group=1, dim=64, dtype=torch.float32, paged=False)
    att = TritonAttention(DEVICE)
    too_long = [SimpleNamespace(kv=slots[0].kv, pages=None, start=slots[0].kv.shape[2], q_len=1)]
    with pytest.raises(BackendError, match="cannot hold"):
        att.plan_step(too_long)
    paged = _step([(4, 1)], kv_heads=2, group=1, dim=64, dtype=torch.float32, paged=True)[1]
    with pytest.raises(BackendError, match="mixes paged and contiguous"):
        att.plan_step([slots[0], paged[0]])
    short = [SimpleNamespace(kv=paged[0].kv, pages=[], start=4, q_len=1)]
    with pytest.raises(BackendError, match="cannot hold"):
        att.plan_step(short)
    with pytest.raises(BackendError, match="at least one request"):
        att.plan_step([])
