"""The Triton run-reading kernels (backends/triton_runs.py: odma's vLLM backend on an accelerator) against float64
attention over the same per-head planes, on the cases the CPU kernel is held to (tests/test_run_attention.py): runs,
split runs, scattered blocks, a token, a block, a block and one, thousands; grouped-query heads; reading by runs and
block by block alike; split contexts; bf16 and fp16 caches; the write at its slots, padding skipped. On a GPU they
run compiled (scripts/gpu_check.sh), elsewhere in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from backends import triton_attention  # noqa: E402
from backends.errors import BackendError  # noqa: E402
from backends.triton_attention import Tuning  # noqa: E402
from backends.triton_runs import TritonRunAttention  # noqa: E402
from test_run_attention import BLOCK, CASES, _case, _reference  # noqa: E402 (the CPU kernel's cases)

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not triton_attention.interpreting() else "cpu")
pytestmark = pytest.mark.skipif(triton_attention.available(DEVICE) is not None,
                                reason=f"Triton cannot run here: {triton_attention.available(DEVICE)}")


def _run(case, kv_heads, group, dim, *, dtype=torch.float32, coalesce=True, tuning=None):
    lens, tables = CASES[case]
    planes, table, seq, q_rows, q = _case(lens, tables, kv_heads, group, dim, blocks=400)
    planes, q = planes.to(dtype), q.to(dtype)
    ref = _reference(planes.float(), table, seq, q_rows, q.float())
    kernel = TritonRunAttention(DEVICE, tuning)
    out = torch.zeros_like(q, device=DEVICE)
    kernel.decode(planes.to(DEVICE), BLOCK, table.to(DEVICE), seq.to(DEVICE), q_rows.to(DEVICE), q.to(DEVICE), out,
                  dim ** -0.5, coalesce=coalesce)
    return out.cpu().double(), ref, q_rows


@pytest.mark.parametrize("case,kv_heads,group,dim", [("ragged", 3, 3, 64), ("ragged", 2, 4, 128),
                                                     ("ragged", 1, 7, 128), ("long one-run and scattered", 2, 4, 128)])
def test_decode_matches_float64_reading_runs_or_blocks(case, kv_heads, group, dim):
    runs, ref, q_rows = _run(case, kv_heads, group, dim)
    blocks, _, _ = _run(case, kv_heads, group, dim, coalesce=False)
    assert (runs - ref).abs().max() < 1e-5
    assert torch.equal(runs, blocks)  # the same arithmetic, whichever way the rows were found
    untouched = [0, q_rows.numel() + 1]  # rows of q that are not decode rows stay as they were
    assert not runs[untouched].any()


def test_split_contexts_reduce_to_the_same_attention():
    whole, ref, _ = _run("long one-run and scattered", 2, 4, 64, tuning=Tuning(split_tokens=1 << 20))
    split, _, _ = _run("long one-run and scattered", 2, 4, 64, tuning=Tuning(split_tokens=256))  # 12 splits
    assert (whole - ref).abs().max() < 1e-5 and (split - ref).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches(dtype):
    out, ref, _ = _run("ragged", 2, 4, 128, dtype=dtype)
    assert (out - ref).abs().max() < 2e-2


def test_one_runs_are_found_on_the_device():
    lens, tables = CASES["ragged"]
    _, table, seq, _, _ = _case(lens, tables, 1, 1, 32, blocks=400)
    first = TritonRunAttention(DEVICE).first_rows(table.to(DEVICE), seq.to(DEVICE), BLOCK, coalesce=True)
    # [5], [0]: one block each; [1, 2]: a run; [30, 31, 9] and [12, 40, 41]: their third block breaks the run;
    # 50..62: a run of 13 (the table's zero padding past a request's blocks is not read)
    assert first.tolist() == [5 * BLOCK, 0, BLOCK, -1, -1, 50 * BLOCK]
    assert TritonRunAttention(DEVICE).first_rows(table.to(DEVICE), seq.to(DEVICE), BLOCK,
                                                 coalesce=False).tolist() == [-1] * 6


def test_the_write_stores_rows_at_their_slots_and_skips_padding():
    kv_heads, dim = 2, 64
    planes = torch.zeros(kv_heads, 8 * BLOCK, 2 * dim, device=DEVICE)
    key = torch.randn(4, kv_heads, dim, device=DEVICE)
    value = torch.randn(4, kv_heads, dim, device=DEVICE)
    slots = torch.tensor([3, -1, 17, 127], dtype=torch.int64, device=DEVICE)
    TritonRunAttention(DEVICE).write(planes, key, value, slots)
    for j, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(planes[:, slot, :dim], key[j]) and torch.equal(planes[:, slot, dim:], value[j])
    assert int((planes.abs().sum(-1) > 0).sum()) == 3 * kv_heads  # nothing written for the padding token


def test_shapes_it_cannot_read_are_refused():
    kernel = TritonRunAttention(DEVICE)
    planes = torch.zeros(2, 4 * BLOCK, 128, device=DEVICE)
    q = torch.zeros(1, 4, 64, device=DEVICE)
    table, lens = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE), torch.ones(1, dtype=torch.int32, device=DEVICE)
    rows = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(BackendError, match="one dtype"):
        kernel.decode(planes, BLOCK, table, lens, rows, q.half(), q.half(), 0.1)
    with pytest.raises(BackendError, match="int32"):
        kernel.decode(planes, BLOCK, table.long(), lens, rows, q, q.clone(), 0.1)
    with pytest.raises(BackendError, match="share"):
        kernel.decode(planes, BLOCK, table, lens, rows, torch.zeros(1, 3, 64, device=DEVICE),
                      torch.zeros(1, 3, 64, device=DEVICE), 0.1)
    with pytest.raises(BackendError, match="do not fit"):
        kernel.write(planes, torch.zeros(1, 3, 64, device=DEVICE), torch.zeros(1, 3, 64, device=DEVICE),
                     torch.zeros(1, dtype=torch.int64, device=DEVICE))
