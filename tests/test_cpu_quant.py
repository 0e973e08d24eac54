"""The GEMM on GGUF-quantized weights (backends/cpu_quant.py, csrc/quant_linear.c): packed blocks dequantize to
gguf-py's very floats, and with fp32 activations the GEMM on them gives the fp32 kernel's bits on those floats (up
to ROWS rows dequantized in registers, more through the panel buffer), at row, column and depth tails, on every
thread count; with int8 activations (integer dot products) it gives, up to fp32 rounding, the product of the
dequantized weights with activations quantized as a numpy reference quantizes them. Once per instruction set this
CPU runs (test ids and pytest's header name them)."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from backends import BackendError, ckernels, cpu_linear, cpu_quant

gguf = pytest.importorskip("gguf")


def runnable() -> dict[str, tuple[cpu_quant.QuantKernel, cpu_linear.LinearKernel]]:
    out = {}
    for isa in ckernels.ISAS:
        if not ckernels.isa_runs_here(isa):
            continue
        q, f = cpu_quant.load(isa), cpu_linear.load(isa)
        if q is not None and f is not None:
            out.setdefault(q.isa, (q, f))
    return out


KERNELS = runnable()
per_isa = pytest.mark.parametrize("kernels", list(KERNELS.values()), ids=list(KERNELS))
TYPES = pytest.mark.parametrize("ggml_id", list(cpu_quant.BLOCK_TYPES), ids=[t.name for t in cpu_quant.BLOCK_TYPES.values()])


def random_blocks(ggml_id: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """n rows of random blocks of the type, their fp16 scales and mins set to sane values (not NaN or huge)."""
    t = cpu_quant.BLOCK_TYPES[ggml_id]
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 256, size=(n, k // t.block * t.block_bytes), dtype=np.uint8)
    b = rows.reshape(n, -1, t.block_bytes)
    halves = {"Q4_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}[t.name]
    for at in halves:
        b[..., at:at + 2] = rng.uniform(-0.05, 0.05, size=(*b.shape[:-1], 1)).astype(np.float16).view(np.uint8)
    return rows


def reference(ggml_id: int, rows: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.dequantize(rows, gguf.GGMLQuantizationType(ggml_id)).astype(np.float32))


@contextmanager
def activations(kernel: cpu_quant.QuantKernel, mode: str):
    before = kernel.activations
    kernel.activations = mode
    try:
        yield kernel
    finally:
        kernel.activations = before


def with_int8(kernels):
    """The (quantized, fp32) kernels of a build with an integer dot product; the test skips on one without."""
    if kernels[0].int8 == "none":
        pytest.skip(f"the {kernels[0].isa} build has no integer dot product")
    return kernels


def quantized_activations(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """What the kernel multiplies with int8 activations, in float64: per row and block of 16 depths d = max|x| / 127
    (fp32), q = x * (1 / d) rounded to nearest even (fp32), x = q * d."""
    b = x.numpy().astype(np.float32).reshape(x.shape[0], -1, block)
    d = (np.abs(b).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint(b * inv)
    assert np.abs(q).max() <= 127
    return torch.from_numpy((q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape))


@per_isa
@TYPES
@pytest.mark.parametrize("n", [1, 23, 49, 100])
def test_packed_blocks_dequantize_to_gguf_pys_floats(kernels, ggml_id, n):
    q, _ = kernels
    k = 512
    rows = random_blocks(ggml_id, n, k, seed=n)
    packed = q.pack(ggml_id, rows, k)
    out = q.dequantize(packed, ggml_id, k, n)
    ref = reference(ggml_id, rows).reshape(n, k)
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))  # bit for bit, signed zeros included


# bytes a packed column keeps per block of the type against the file's: Q4_K's d and dmin stay fp16 and its 6-bit sc
# and m take a byte each (148 against 144); every other type exactly as its file
PACKED_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 148, "Q6_K": 210}


@per_isa
@TYPES
def test_packed_weights_keep_their_files_size(kernels, ggml_id):
    q, _ = kernels
    t = cpu_quant.BLOCK_TYPES[ggml_id]
    n, k = 2 * q.panel, 768
    rows = random_blocks(ggml_id, n, k)
    packed = q.pack(ggml_id, rows, k)
    assert packed.numel() == n * k // t.block * PACKED_BLOCK_BYTES[t.name]
    assert packed.numel() <= rows.nbytes * 1.03


@per_isa
@TYPES
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 17, 129])
def test_the_gemm_gives_the_fp32_kernels_bits_on_the_dequantized_weights(kernels, ggml_id, rows):
    # rows: within one register pass (AVX2 4, AVX-512 8), past it (the L1 tile), past 128 (the panel buffer);
    # columns 70: a panel tail
    q, f = kernels
    n, k = 70, 256
    blocks = random_blocks(ggml_id, n, k, seed=rows)
    packed = q.pack(ggml_id, blocks, k)
    w = q.dequantize(packed, ggml_id, k, n)
    g = torch.Generator().manual_seed(rows)
    x, b = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    with activations(q, "f32"):
        out = q(x, packed, ggml_id, n, b)
    assert torch.equal(out, f(x, f.pack(w), b, n))
    scale = float((x.double().abs() @ w.double().abs().T).max())  # fp32 sums of k products: errors scale with this
    torch.testing.assert_close(out.double(), F.linear(x.double(), w.double(), b.double()), rtol=0, atol=1e-6 * scale)


@per_isa
@pytest.mark.parametrize("rows", [2, 13])
def test_threads_split_panels_without_changing_a_bit(kernels, rows):
    q, _ = kernels
    blocks = random_blocks(3, 300, 128)
    packed = q.pack(3, blocks, 128)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    for mode in ("f32", "int8") if q.int8 != "none" else ("f32",):
        try:
            with activations(q, mode):
                torch.set_num_threads(1)
                one = q(x, packed, 3, 300)
                torch.set_num_threads(3)
                three = q(x, packed, 3, 300)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(one, three), mode


@per_isa
def test_parts_of_different_types_write_their_own_columns(kernels):
    """A fused layer whose tensors differ in type (Q4_K q beside Q6_K v): each part fills its columns of one y."""
    from odma.models.quantized import QuantLinear, QuantPart

    q, _ = kernels
    k = 256
    a, b = random_blocks(12, 40, k, seed=1), random_blocks(14, 30, k, seed=2)
    layer = QuantLinear(q, k, [QuantPart(q.pack(12, a, k), 12, 40), QuantPart(q.pack(14, b, k), 14, 30)],
                        bias=torch.arange(70.0))
    x = torch.randn(3, 2, k)
    w = torch.cat([reference(12, a).reshape(40, k), reference(14, b).reshape(30, k)])
    with activations(q, "f32"):
        out = layer(x)
    assert out.shape == (3, 2, 70)
    torch.testing.assert_close(out.double(), F.linear(x.double(), w.double(), torch.arange(70.0).double()),
                               rtol=1e-5, atol=1e-3)


@per_isa
def test_bad_blocks_are_refused_in_words(kernels):
    q, _ = kernels
    with pytest.raises(ValueError, match="no quantized kernel"):
        q.pack(13, np.zeros((4, 176), np.uint8), 256)  # Q5_K: not read by the kernel
    with pytest.raises(ValueError, match="do not hold 64 depths"):
        q.pack(3, np.zeros((4, 30), np.uint8), 64)  # a Q4_1 row of 64 depths is 2 blocks of 20 bytes
    with pytest.raises(ValueError, match="do not hold 48 depths"):
        q.pack(3, np.zeros((4, 40), np.uint8), 48)  # not a whole number of blocks


needs_int8 = pytest.mark.skipif(not any(q.int8 != "none" for q, _ in KERNELS.values()),
                                reason="no build here has an integer dot product")


@per_isa
@TYPES
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17, 129])
def test_int8_activations_give_the_product_with_the_activations_quantized(kernels, ggml_id, rows):
    # rows: within one integer pass (AVX2 2, AVX-512 4) and past it; columns 70: a panel tail; K 512: 16 scales
    q, f = with_int8(kernels)
    n, k = 70, 512
    blocks = random_blocks(ggml_id, n, k, seed=rows)
    packed = q.pack(ggml_id, blocks, k)
    w = reference(ggml_id, blocks).reshape(n, k).double()
    g = torch.Generator().manual_seed(rows)
    x, b = torch.randn(rows, k, generator=g) * 3, torch.randn(n, generator=g)
    with activations(q, "int8"):
        out = q(x, packed, ggml_id, n, b)
    with activations(q, "f32"):
        exact = q(x, packed, ggml_id, n, b)
    xq = quantized_activations(x)
    ref = F.linear(xq, w, b.double())
    # the integer sums are exact; what is left is fp32 rounding of a few products and sums per 16 depths. One
    # activation rounded the other way would be off by d * |w| ~ 3e-5 of `scale` here: 1e-6 catches it.
    scale = float((xq.abs() @ w.abs().T).max())
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-6 * scale)
    assert not torch.equal(out, exact)  # the integer path ran, not the fp32 one
    torch.testing.assert_close(out, exact, rtol=0, atol=0.02 * scale)  # and 16-depth int8 is close to fp32


@per_isa
@TYPES
def test_int8_rows_together_give_the_bits_of_rows_alone(kernels, ggml_id):
    # one row reads a Q6_K panel as packed; 64 rows and more read the panel's wide copy (fp32 scales, q a byte
    # each): the same sums in the same order, so the same bits (and so for every type, whatever the row count)
    q, _ = with_int8(kernels)
    n, k = 70, 512
    packed = q.pack(ggml_id, random_blocks(ggml_id, n, k, seed=5), k)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(5))
    with activations(q, "int8"):
        together = q(x, packed, ggml_id, n)
        alone = torch.cat([q(x[i:i + 1], packed, ggml_id, n) for i in range(len(x))])
    assert torch.equal(together, alone)


@per_isa
def test_zero_and_large_activation_blocks(kernels):
    q, _ = with_int8(kernels)
    k, n = 64, 30
    blocks = random_blocks(2, n, k)
    x = torch.zeros(2, k)
    x[1, 16:32] = 1e30  # far beyond fp16: the activation scales are fp32
    with activations(q, "int8"):
        out = q(x, q.pack(2, blocks, k), 2, n)
    w = reference(2, blocks).reshape(n, k).double()
    assert torch.equal(out[0], torch.zeros(n))
    torch.testing.assert_close(out.double(), F.linear(quantized_activations(x), w), rtol=1e-5, atol=0)
    x[0, 40] = float("nan")  # a NaN reaches y, as on the fp32 path
    with activations(q, "int8"):
        out = q(x, q.pack(2, blocks, k), 2, n)
    assert out[0].isnan().all() and not out[1].isnan().any()


@per_isa
def test_auto_takes_int8_up_to_the_types_row_limit(kernels, monkeypatch):
    q, _ = with_int8(kernels)
    k, n = 128, 50
    packed = q.pack(3, random_blocks(3, n, k), k)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(3))

    def run(mode: str, rows: int) -> torch.Tensor:
        with activations(q, mode):
            return q(x[:rows], packed, 3, n)

    assert torch.equal(run("auto", 6), run("int8", 6))  # no limit for Q4_1 by default
    monkeypatch.setitem(cpu_quant.INT8_ROWS, "Q4_1", 4)
    assert torch.equal(run("auto", 4), run("int8", 4)) and not torch.equal(run("auto", 4), run("f32", 4))
    assert torch.equal(run("auto", 5), run("f32", 5)) and not torch.equal(run("auto", 5), run("int8", 5))


def test_the_activations_switch_is_checked(monkeypatch):
    monkeypatch.setenv("ODMA_QUANT_ACTIVATIONS", "int 8")
    with pytest.raises(BackendError, match="ODMA_QUANT_ACTIVATIONS='int 8': expected one of auto, f32, int8"):
        cpu_quant.requested_activations()
    monkeypatch.setenv("ODMA_QUANT_ACTIVATIONS", " F32 ")
    assert cpu_quant.requested_activations() == "f32"
    monkeypatch.delenv("ODMA_QUANT_ACTIVATIONS")
    assert cpu_quant.requested_activations() == "auto"
    for q, _ in KERNELS.values():
        with pytest.raises(BackendError, match="expected one of"):
            q.activations = "fp32"


@TYPES
def test_int8_activations_give_the_same_bits_on_every_build(ggml_id):
    """Exact int32 sums and the same fp32 steps after them: VNNI and vpmaddubsw builds agree bit for bit."""
    builds = [q for q, _ in KERNELS.values() if q.int8 != "none"]
    if len(builds) < 2:
        pytest.skip("fewer than two builds with integer dot products here")
    blocks = random_blocks(ggml_id, 100, 512, seed=5)
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(5))
    outs = []
    for q in builds:
        with activations(q, "int8"):
            outs.append(q(x, q.pack(ggml_id, blocks, 512), ggml_id, 100))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
