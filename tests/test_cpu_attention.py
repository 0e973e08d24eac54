"""The CPU backend's decode-attention kernel computes what SDPA computes, writes only the new row of each
block and never writes past a block (its absence, no compiler or disabled: tests/test_ckernels.py)."""

from __future__ import annotations

import shutil

import pytest
import torch

from backends import cpu_attention, get_backend
from odma.models import load_model
from odma.models.llama import SeqSlot
from odma.models.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler to build the kernel")


@pytest.fixture(scope="module")
def kernel():
    k = get_backend("cpu").decode_attention()
    assert k is not None, "a C compiler is on PATH, so the kernel must build"
    return k


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    return load_model(folder), AutoModelForCausalLM.from_pretrained(str(folder)).eval()


def _blocks(model, capacities, storages: int = 2):
    """Blocks carved from `storages` separate flat buffers (as a segmented arena's blocks are)."""
    c = model.config
    per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim
    flats = [torch.randn(sum(capacities) * per_token) for _ in range(storages)]
    out, used = [], [0] * storages
    for i, cap in enumerate(capacities):
        s = i % storages
        out.append(flats[s][used[s] * per_token:(used[s] + cap) * per_token].view(
            c.num_layers, 2, cap, c.num_kv_heads, c.head_dim))
        used[s] += cap
    return out


def test_decode_logits_match_transformers_through_the_kernel(tiny, kernel):
    ours, hf = tiny
    ids = torch.randint(3, 250, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    kv = _blocks(ours, [24], storages=1)[0]
    ours(ids[:12], torch.arange(12), [SeqSlot(kv, 0, 12)], kernel)  # prefill: SDPA
    for i in range(12, 20):
        out = ours(ids[i:i + 1], torch.tensor([i]), [SeqSlot(kv, i, 1)], kernel)
        torch.testing.assert_close(out[0], ref[i], atol=1e-4, rtol=1e-4)


def test_a_mixed_step_equals_sdpa_in_logits_and_cache(tiny, kernel):
    ours, _ = tiny
    g = torch.Generator().manual_seed(3)
    # decode at several contexts (one at position 0), a prefill chunk after cached tokens, a whole prompt
    starts, q_lens, caps = [0, 5, 17, 9, 0, 30], [1, 1, 6, 1, 4, 1], [8, 16, 32, 10, 4, 31]
    a, b = _blocks(ours, caps), _blocks(ours, caps)
    for x, y in zip(a, b):
        y.copy_(x)
    ids = torch.randint(3, 250, (sum(q_lens),), generator=g)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)])
    plain = ours(ids, pos, [SeqSlot(kv, s, n) for kv, s, n in zip(a, starts, q_lens)])
    fast = ours(ids, pos, [SeqSlot(kv, s, n) for kv, s, n in zip(b, starts, q_lens)], kernel)
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, atol=1e-6, rtol=0)


def test_only_the_new_row_is_written(tiny, kernel):
    ours, _ = tiny
    c = ours.config
    kv = torch.full((c.num_layers, 2, 12, c.num_kv_heads, c.head_dim), 7.0)
    ours(torch.tensor([4]), torch.tensor([5]), [SeqSlot(kv, 5, 1)], kernel)
    assert torch.all(kv[:, :, 6:] == 7.0) and torch.all(kv[:, :, :5] == 7.0)
    assert not torch.any(kv[:, :, 5] == 7.0)


def test_the_plan_skips_what_the_kernel_cannot_read(tiny, kernel):
    ours, _ = tiny
    c = ours.config
    full = _blocks(ours, [4], storages=1)[0]
    half = torch.zeros(c.num_layers, 2, 8, c.num_kv_heads, c.head_dim, dtype=torch.bfloat16)
    strided = torch.zeros(c.num_layers, 2, 8, c.num_kv_heads, 2 * c.head_dim)[..., ::2]
    ok = torch.zeros(c.num_layers, 2, 8, c.num_kv_heads, c.head_dim)
    # a full block (start == capacity) would be written past its end; bf16 and non-contiguous rows are not read
    plan = kernel.plan([full, half, strided, ok, ok], [4, 3, 3, 3, 2], [1, 1, 1, 1, 2])
    assert plan.picked == frozenset({3}) and plan.rows.tolist() == [3]
    assert kernel.plan([ok], [0], [5]) is None  # nothing decoding


def test_splitting_over_worker_threads_changes_nothing(tiny, kernel):
    ours, _ = tiny
    c = ours.config
    g = torch.Generator().manual_seed(5)
    starts = [3, 40, 7, 0, 25, 11, 60]
    blocks = _blocks(ours, [s + 4 for s in starts])
    q = torch.randn(len(starts), c.num_heads, c.head_dim, generator=g)
    k, v = (torch.randn(len(starts), c.num_kv_heads, c.head_dim, generator=g) for _ in range(2))
    one = kernel.plan(blocks, starts, [1] * len(starts), workers=1)
    three = kernel.plan(blocks, starts, [1] * len(starts), workers=3)
    assert len(one.shares) == 1 and len(three.shares) == 3
    covered = [i for lo, hi in three.shares for i in range(lo, hi)]
    assert covered == list(range(len(starts)))  # every request in exactly one share, in order
    for layer in range(c.num_layers):
        torch.testing.assert_close(three.attend(layer, q, k, v), one.attend(layer, q, k, v), atol=0, rtol=0)


def test_a_compiler_without_march_native_gets_the_portable_build(monkeypatch, tmp_path):
    real = shutil.which("cc") or shutil.which("gcc")
    wrapper = tmp_path / "cc-no-native"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -march=native ] && exit 1; done\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr(cpu_attention.load, "_tried", False)
    monkeypatch.setattr(cpu_attention.load, "_loaded", None)
    monkeypatch.setenv("ODMA_CPU_KERNELS", "1")
    monkeypatch.setenv("ODMA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(wrapper))
    assert cpu_attention.load() is not None
    assert len(list((tmp_path / "cache").rglob("*.so"))) == 1  # the portable one; the refused build left nothing


# the kernel's shapes compiled with constant group size and head_dim (3/64, 4/64, 8/128), and the generic loop
# and each in both cache dtypes: fp16 rows are widened (the step's new row rounded as torch rounds it)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 64), (16, 2, 128), (9, 3, 12), (6, 3, 64)])
def test_kernel_matches_a_float64_reference_at_every_row_tail(kernel, heads, kv_heads, head_dim, dtype):
    cap = 48
    g = torch.Generator().manual_seed(7)
    lens = [1, 7, 8, 9, 16, 17, 33]  # a single row, rows fewer and more than the kernel prefetches ahead (8)
    blocks = [torch.randn(1, 2, cap, kv_heads, head_dim, generator=g).to(dtype) for _ in lens]
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    k, v = (torch.randn(len(lens), kv_heads, head_dim, generator=g) for _ in range(2))
    ref = []
    for i, n in enumerate(lens):
        kk = torch.cat([blocks[i][0, 0, : n - 1], k[i : i + 1].to(dtype)]).double()
        vv = torch.cat([blocks[i][0, 1, : n - 1], v[i : i + 1].to(dtype)]).double()
        qq = q[i].double().view(kv_heads, heads // kv_heads, head_dim)
        s = torch.einsum("kgd,tkd->kgt", qq, kk) * head_dim ** -0.5
        ref.append(torch.einsum("kgt,tkd->kgd", s.softmax(-1), vv).reshape(heads, head_dim))
    batch = kernel.plan(blocks, [n - 1 for n in lens], [1] * len(lens), workers=1)
    assert batch.half == (dtype == torch.float16)
    out = batch.attend(0, q, k, v)
    torch.testing.assert_close(out.double(), torch.stack(ref), atol=1e-5, rtol=1e-5)
    for i, n in enumerate(lens):  # the new row, written in the cache's dtype with torch's rounding
        assert torch.equal(blocks[i][0, 0, n - 1], k[i].to(dtype)) and torch.equal(blocks[i][0, 1, n - 1], v[i].to(dtype))


def test_one_step_takes_one_cache_dtype(kernel):
    blocks = [torch.zeros(1, 2, 8, 1, 16), torch.zeros(1, 2, 8, 1, 16, dtype=torch.float16)]
    with pytest.raises(ValueError, match="several dtypes"):
        kernel.plan(blocks, [0, 0], [1, 1])
    assert kernel.plan(blocks[:1], [0], [1]).half is False


def _split(block: torch.Tensor, cuts: list[int], g: torch.Generator):
    """The rows of `block` [layers, 2, cap, kvh, d] cut at `cuts` into pieces, each in a block of its own that holds
    its rows from a row of its own choosing (as a continued block's, or a holder's that itself reads pieces), with
    other rows around them; then the own block holding the rows from the last cut. Returns (pieces, own)."""
    pieces, lo = [], 0
    for end in cuts:
        first = max(0, lo - int(torch.randint(0, 3, (1,), generator=g)))  # the piece's block may hold earlier rows
        view = torch.randn(block.shape[0], 2, end - first + 5, *block.shape[3:], generator=g).to(block.dtype)
        view[:, :, lo - first:end - first] = block[:, :, lo:end]
        pieces.append((view, first, end))
        lo = end
    own = torch.randn(block.shape[0], 2, block.shape[2] - lo, *block.shape[3:], generator=g).to(block.dtype)
    own[:, :, :] = block[:, :, lo:]
    return pieces, own


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 64), (9, 3, 12)])
@pytest.mark.parametrize("workers", [1, 3])
def test_rows_read_through_pieces_give_the_contiguous_blocks_result(kernel, heads, kv_heads, head_dim, dtype, workers):
    g = torch.Generator().manual_seed(11)
    lens = [1, 9, 12, 17, 33, 40]  # a request without pieces, one piece, several, a last piece ending at the new row
    cuts = [[], [4], [3, 6, 10], [16], [1, 8, 9, 20], [16, 32]]
    cap = 48
    contiguous = [torch.randn(2, 2, cap, kv_heads, head_dim, generator=g).to(dtype) for _ in lens]
    split = [_split(b, c, g) for b, c in zip(contiguous, cuts)]
    untouched = [[view.clone() for view, _, _ in pieces] for pieces, _ in split]
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    k, v = (torch.randn(len(lens), kv_heads, head_dim, generator=g) for _ in range(2))
    plain = kernel.plan(contiguous, [n - 1 for n in lens], [1] * len(lens), workers=workers)
    pieced = kernel.plan([own for _, own in split], [n - 1 for n in lens], [1] * len(lens), workers=workers,
                         pieces=[pieces or None for pieces, _ in split])
    assert plain.pieces is None and pieced.pieces.start.tolist() == [0, 0, 1, 4, 5, 9, 11]
    for layer in (0, 1):
        torch.testing.assert_close(pieced.attend(layer, q, k, v), plain.attend(layer, q, k, v), atol=1e-6, rtol=1e-6)
    for i, ((pieces, own), n) in enumerate(zip(split, lens)):
        first = pieces[-1][2] if pieces else 0
        assert torch.equal(own[:, :, n - 1 - first], contiguous[i][:, :, n - 1])  # the new row, in its own block
        assert all(torch.equal(view, before) for (view, _, _), before in zip(pieces, untouched[i]))  # read only


def test_a_step_with_pieces_runs_the_kernel_and_equals_the_models_own_path(tiny, kernel):
    """The model's decode through the kernel with pieces: the logits of its own path (torch.cat of the pieces and
    SDPA)."""
    ours, _ = tiny
    g = torch.Generator().manual_seed(13)
    starts = [20, 9]
    blocks = _blocks(ours, [32, 16])
    ids = torch.randint(3, 250, (2,), generator=g)
    fast_slots, plain_slots = [], []
    for kv, start, cuts in zip(blocks, starts, ([6, 14], [])):
        pieces, own = _split(kv, cuts, g)
        for slots in (fast_slots, plain_slots):
            copies = [(view.clone(), first, end) for view, first, end in pieces]
            slots.append(SeqSlot(own.clone(), start, 1, pieces=copies or None))
    decode = kernel.plan_step(fast_slots)
    assert decode is not None and decode.rows is None and decode.pieces is not None
    fast = ours(ids, torch.tensor(starts), fast_slots, kernel)
    plain = ours(ids, torch.tensor(starts), plain_slots)
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)
    for a, b in zip(fast_slots, plain_slots):
        torch.testing.assert_close(a.kv, b.kv, atol=1e-6, rtol=0)


def test_pieces_that_do_not_meet_the_own_block_are_refused(kernel):
    views = [torch.zeros(1, 2, 8, 1, 16) for _ in range(2)]
    own = torch.zeros(1, 2, 8, 1, 16)
    batch = kernel.plan([own], [9], [1], pieces=[[(views[0], 0, 4)]])
    batch.pieces.end[0] = 3  # the own block says it holds rows from 4 on: a gap in the rows
    with pytest.raises(RuntimeError, match="codes"):
        batch.attend(0, torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), torch.zeros(1, 1, 16))
