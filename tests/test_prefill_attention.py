"""A prefill chunk's attention in the native step (csrc/prefill_attend.h, tiled; attend.h, row by row): the chunk's
rows attend causally over the prefix before them and over each other as torch's SDPA computes it (GQA, fp32 and fp16
caches, head_dim 64 and 128, chunks appended after cached rows, blocks of rows and tiles of keys cut anywhere), in
every instruction-set build this CPU runs; and a prompt far past 512 tokens prefilled in native chunks gives the
Python layers' logits, next tokens and KV rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backends import ckernels, cpu_attention, cpu_step
from odma.models.llama import SeqSlot
from odma.models.native_step import NativeLayers

from test_cpu_step import build  # noqa: E402 (the step's test models)
from test_gguf_native import KERNELS  # noqa: E402

pytestmark = pytest.mark.skipif(ckernels.disabled(), reason="ODMA_CPU_KERNELS=0 turns the C kernels off")
ISAS = [isa for isa in ckernels.ISAS if ckernels.isa_runs_here(isa)]
SHAPES = {"smollm2": (9, 3, 64), "llama-1b": (32, 8, 64), "llama-8b": (8, 2, 128), "mha": (4, 4, 128)}
# (cached rows before the chunk, chunk rows): one row; a few (row by row in the step); blocks of rows and tiles of 64
# keys cut at odd places; a chunk after 513 cached rows
CHUNKS = [(0, 1), (7, 3), (0, 37), (20, 17), (64, 64), (100, 130), (513, 300)]


@pytest.fixture(scope="module", params=ISAS)
def kernel(request):
    k = cpu_step.load(request.param)
    assert k is not None, f"the decode-step kernel did not build for ODMA_CPU_ISA={request.param}"
    return k


def sdpa(kv: torch.Tensor, q: torch.Tensor, start: int) -> torch.Tensor:
    """torch's causal attention of q [rows, heads, dim] at positions start.. over kv's rows [0, start + rows)."""
    rows, heads, _ = q.shape
    n = start + rows
    k, v = (kv[i, :n].float().transpose(0, 1) for i in (0, 1))  # [kv_heads, n, dim]
    group = heads // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    causal = torch.arange(n)[None, :] <= start + torch.arange(rows)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=causal).transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["kv-fp32", "kv-fp16"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("start,rows", CHUNKS)
def test_a_chunk_attends_as_sdpa_does(kernel, shape, dtype, start, rows):
    heads, kv_heads, dim = SHAPES[shape]
    gen = torch.Generator().manual_seed(start * 1000 + rows)
    kv = torch.randn(2, start + rows + 5, kv_heads, dim, generator=gen).to(dtype)  # rows past the chunk: unread
    kv[:, start + rows:] = float("nan")
    q = torch.randn(rows, heads, dim, generator=gen)
    want = sdpa(kv, q, start)
    tiled = kernel.chunk_attention(kv, q, start, min_rows=1)
    by_row = kernel.chunk_attention(kv, q, start, min_rows=rows + 1)
    as_step = kernel.chunk_attention(kv, q, start)  # the step's choice: tiled from kernel.tiled_rows rows
    torch.testing.assert_close(tiled, want, rtol=1e-4, atol=3e-5)
    torch.testing.assert_close(by_row, want, rtol=1e-4, atol=3e-5)
    assert torch.equal(as_step, tiled if rows >= kernel.tiled_rows else by_row)


def test_threads_split_a_chunk_into_the_same_attention(kernel):
    kv = torch.randn(2, 400, 3, 64)
    q = torch.randn(300, 9, 64)
    one = kernel.chunk_attention(kv, q, 100, threads=1)
    assert torch.equal(kernel.chunk_attention(kv, q, 100, threads=3), one)  # each block written by one thread alone


def test_bad_chunks_are_refused(kernel):
    kv = torch.zeros(2, 16, 3, 64)
    with pytest.raises(ValueError, match="positions up to 17"):
        kernel.chunk_attention(kv, torch.zeros(7, 9, 64), 10)
    with pytest.raises(ValueError, match="heads a multiple"):
        kernel.chunk_attention(kv, torch.zeros(2, 8, 64), 0)
    with pytest.raises(ValueError, match="expected"):
        kernel.chunk_attention(kv.to(torch.bfloat16), torch.zeros(2, 9, 64), 0)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["kv-fp32", "kv-fp16"])
@pytest.mark.parametrize("case,isa", [("fp32", isa) for isa in ISAS] + [("llama-Q4_1", "auto")])
def test_a_long_prompt_prefilled_natively_gives_the_python_layers_logits(case, isa, kv_dtype, tmp_path, monkeypatch):
    """A 700-token prompt in chunks of 256 (the last after 512 cached rows) beside another prompt's 3-row chunks,
    then a decode step: through the native step (every chunk; counted) and through the Python layers
    (SDPA), the same logits within float tolerance, the same next tokens, the same K/V rows."""
    kernels = next(iter(KERNELS.values()))
    model = build(case, kernels, tmp_path)
    attention = cpu_attention.load()
    c = model.config
    prompt = [(7 + 13 * i) % c.vocab_size for i in range(700)]
    chunks = [(0, 256), (256, 256), (512, 188)]
    threads, activations = torch.get_num_threads(), kernels[0].activations
    results = {}
    try:
        torch.set_num_threads(1)
        kernels[0].activations = "f32"
        for mode in ("decode", "native"):  # decode: steps with prefill rows through the Python layers
            monkeypatch.setenv("ODMA_CPU_STEP", mode)
            model.native_layers = NativeLayers.build(model, cpu_step.load(isa))
            native_runs = []
            run = model.native_layers.run
            model.native_layers.run = lambda *a, **k: native_runs.append(a[1].lens.numel()) or run(*a, **k)
            blocks = [torch.zeros(c.num_layers, 2, 720, c.num_kv_heads, c.head_dim, dtype=kv_dtype) for _ in range(2)]
            logits = []
            for step, (start, n) in enumerate(chunks):  # the other prompt 3 rows a step: row by row in the kernel
                slots = [SeqSlot(blocks[0], start, n), SeqSlot(blocks[1], 3 * step, 3)]
                ids = torch.tensor(prompt[start:start + n] + prompt[3 * step:3 * step + 3])
                positions = torch.tensor(list(range(start, start + n)) + list(range(3 * step, 3 * step + 3)))
                logits.append(model(ids, positions, slots, attention))
            token = logits[-1][0].argmax()
            logits.append(model(token[None], torch.tensor([700]), [SeqSlot(blocks[0], 700, 1)], attention))
            results[mode] = logits, blocks, native_runs
    finally:
        torch.set_num_threads(threads)
        kernels[0].activations = activations
    (native, native_blocks, runs), (python, python_blocks, python_runs) = results["native"], results["decode"]
    assert runs == [n + 3 for _, n in chunks] + [1] and python_runs == [1]  # every chunk's layers natively
    for a, b in zip(native, python):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    tol = dict(rtol=1e-4, atol=1e-4) if kv_dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)  # an fp16 ulp
    for a, b in zip(native_blocks, python_blocks):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    assert native_blocks[0][:, :, 701:].abs().sum() == 0
