"""The run-reading CPU kernel (backends/run_attention.py, csrc/run_attention.c) against float64 attention over the same
per-head planes: requests whose blocks are one run, scattered, or both, contexts of one token, exactly a block, a
block and one, and thousands; grouped-query heads 1, 3, 4 and 7 (the specialized shapes and the generic loop);
reading by runs and block by block alike; the write of new rows at their slots, padding skipped."""

from __future__ import annotations

import random

import pytest
import torch

from backends.errors import BackendError
from backends.run_attention import load

kernel = load()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C compiler for the run kernel")

BLOCK = 16


def _case(lens, tables, kv_heads, group, dim, blocks, seed=0):
    gen = torch.Generator().manual_seed(seed)
    planes = torch.randn(kv_heads, blocks * BLOCK, 2 * dim, generator=gen)
    width = max(len(t) for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    q = torch.randn(len(lens) + 2, kv_heads * group, dim, generator=gen)  # two rows that are not decode rows
    q_rows = torch.tensor([i + 1 for i in range(len(lens))], dtype=torch.int64)  # row 0 and the last untouched
    return planes, table, torch.tensor(lens, dtype=torch.int32), q_rows, q


def _reference(planes, table, lens, q_rows, q):
    kv_heads, _, width = planes.shape
    dim = width // 2
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        rows = torch.cat([torch.arange(blk * BLOCK, blk * BLOCK + BLOCK) for blk in table[b].tolist()])[:n]
        k = planes[:, rows, :dim].double().repeat_interleave(group, 0)  # [heads, n, dim]
        v = planes[:, rows, dim:].double().repeat_interleave(group, 0)
        qb = q[q_rows[b]].double()
        p = torch.softmax(torch.einsum("hd,hnd->hn", qb, k) / dim ** 0.5, -1)
        out[q_rows[b]] = torch.einsum("hn,hnd->hd", p, v)
    return out


CASES = {
    # lens, block tables: one run, a run split in two, scattered, one token, exactly a block, a block and one
    "ragged": ([1, 16, 17, 40, 33, 200], [[5], [0], [1, 2], [30, 31, 9], [12, 40, 41], list(range(50, 63))]),
    "long one-run and scattered": ([3000, 3000], [list(range(0, 188)), random.Random(0).sample(range(188, 400), 188)]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kv_heads,group,dim", [(3, 3, 64), (2, 4, 128), (1, 7, 128), (2, 1, 32), (2, 2, 48)])
def test_decode_matches_float64_reading_runs_or_blocks(case, kv_heads, group, dim):
    lens, tables = CASES[case]
    planes, table, seq, q_rows, q = _case(lens, tables, kv_heads, group, dim, blocks=400)
    ref = _reference(planes, table, seq, q_rows, q)
    for coalesce in (True, False):
        out = torch.full_like(q, 7.0)
        kernel.decode(planes, BLOCK, table, seq, q_rows, q, out, dim ** -0.5, coalesce=coalesce)
        torch.testing.assert_close(out[q_rows].double(), ref[q_rows], rtol=1e-5, atol=1e-5)
        assert torch.all(out[0] == 7.0) and torch.all(out[-1] == 7.0)  # rows of no decode request untouched


def test_threads_split_the_requests_alike():
    lens, tables = CASES["ragged"]
    planes, table, seq, q_rows, q = _case(lens, tables, 3, 3, 64, blocks=400)
    one, two = torch.zeros_like(q), torch.zeros_like(q)
    kernel.decode(planes, BLOCK, table, seq, q_rows, q, one, 0.125)
    kernel.decode(planes, BLOCK, table, seq, q_rows, q, two, 0.125, workers=2)
    assert torch.equal(one, two)


def test_the_write_stores_rows_at_their_slots_and_skips_padding():
    planes = torch.zeros(2, 4 * BLOCK, 2 * 32)
    key, value = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    slots = torch.tensor([5, -1, 63], dtype=torch.int64)
    kernel.write(planes, key, value, slots)
    for t, s in ((0, 5), (2, 63)):
        assert torch.equal(planes[:, s, :32], key[t]) and torch.equal(planes[:, s, 32:], value[t])
    assert int((planes != 0).any(-1).sum()) == 2 * 2  # two rows in each of the two planes, nothing else


def test_shapes_it_cannot_read_are_refused():
    planes, table, seq, q_rows, q = _case([4], [[0]], 1, 2, 32, blocks=4)
    with pytest.raises(BackendError, match="float32"):
        kernel.decode(planes.double(), BLOCK, table, seq, q_rows, q, q.clone(), 1.0)
    with pytest.raises(BackendError, match="int32"):
        kernel.decode(planes, BLOCK, table.long(), seq, q_rows, q, q.clone(), 1.0)
    with pytest.raises(BackendError, match="blocks of"):
        kernel.decode(planes, 24, table, seq, q_rows, q, q.clone(), 1.0)
    big = torch.zeros(1, 4 * BLOCK, 2 * 32)
    with pytest.raises(BackendError, match="refused the shape"):  # 32 query heads per KV head: more than it takes
        kernel.decode(big, BLOCK, table, seq, q_rows, torch.zeros(3, 32, 32), torch.zeros(3, 32, 32), 1.0)
