"""Packed linear layers (odma/models/cpu_linear.py): odma's kernel (backends/cpu_linear.py) and oneDNN give
F.linear's results up to summation order at every row, column and depth tail; packing a model is idempotent,
keeps a tied LM head tied, picks the kernel only where it serves, and can be turned off.

The kernel's tests run once per instruction set this CPU can run (AVX-512 where it has it, AVX2 + FMA through
ODMA_CPU_ISA's forced build): the test ids and pytest's header (tests/conftest.py) name the paths that ran."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backends import ckernels, cpu_linear
from odma.errors import ConfigError
from odma.models import load_model
from odma.models.cpu_linear import (DENSE_ABOVE, LARGE_ROWS, KernelLinear, PackedLinear, linear_mode,
                                    onednn_linear_available, pack_linears, packable_dtypes)
from odma.models.llama import SeqSlot
from odma.models.tiny import make_tiny_model

onednn = pytest.mark.skipif(not onednn_linear_available(), reason="torch built without mkldnn")


def runnable_kernels() -> dict[str, cpu_linear.LinearKernel]:
    """The kernel of each instruction set this CPU runs, by the path it takes (an AVX2-only CPU: one)."""
    out: dict[str, cpu_linear.LinearKernel] = {}
    for isa in ckernels.ISAS:
        kernel = cpu_linear.load(isa) if ckernels.isa_runs_here(isa) else None
        if kernel is not None:
            out.setdefault(kernel.isa, kernel)
    return out


KERNELS = runnable_kernels()
# every kernel test takes `kernel`: one run per path; none (no AVX2, no compiler): an empty set, reported as skipped
per_isa = pytest.mark.parametrize("kernel", list(KERNELS.values()), ids=list(KERNELS))


def packed_layers(model: nn.Module) -> list[nn.Module]:
    """The model's packed layers, without the oneDNN copy a KernelLinear keeps for large steps."""
    layers = [m for m in model.modules() if isinstance(m, (KernelLinear, PackedLinear))]
    inner = {id(m.large) for m in layers if isinstance(m, KernelLinear)}
    return [m for m in layers if id(m) not in inner]


def two_requests(model: nn.Module) -> torch.Tensor:
    """The logits of one packed step of two requests (3 and 2 prompt tokens), each in a fresh block."""
    c = model.config
    blocks = [torch.zeros(c.num_layers, 2, 32, c.num_kv_heads, c.head_dim, dtype=model.dtype) for _ in range(2)]
    ids, pos = torch.tensor([3, 4, 5, 6, 7]), torch.tensor([0, 1, 2, 0, 1])
    return model(ids, pos, [SeqSlot(blocks[0], 0, 3), SeqSlot(blocks[1], 0, 2)])


@onednn
@pytest.mark.parametrize("dense_above", [None, 512])
@pytest.mark.parametrize("rows", [1, 7, 64, 600])
def test_packed_linear_matches_f_linear(rows, dense_above):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=True)
    packed = PackedLinear(lin, dense_above=dense_above)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@onednn
@pytest.mark.skipif(torch.bfloat16 not in packable_dtypes(), reason="no oneDNN bf16 path on this CPU")
@pytest.mark.parametrize("rows", [1, 16, 600])
def test_packed_bf16_linear_matches_f_linear(rows):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=True).to(torch.bfloat16)
    packed = PackedLinear(lin)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    out = packed(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), rtol=1.6e-2, atol=1e-2)


@onednn
def test_a_bf16_model_is_packed_where_onednn_has_bf16(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "llama")
    model = load_model(folder).to(torch.bfloat16)
    n = pack_linears(model)
    linears = sum(type(m) is nn.Linear for m in load_model(folder).modules())
    assert n == (linears if torch.bfloat16 in packable_dtypes() else 0)


@onednn
def test_packing_a_model_keeps_its_outputs_and_tied_head(tmp_path, monkeypatch):
    folder = make_tiny_model(tmp_path / "m", "llama")
    plain, packed = load_model(folder), load_model(folder)
    n = pack_linears(packed)
    assert n == sum(type(m) is nn.Linear for m in plain.modules()) and n > 0
    assert pack_linears(packed) == 0  # idempotent
    assert packed.dtype == torch.float32
    if plain.config.tie_word_embeddings:
        assert packed.lm_head.weight is packed.model.embed_tokens.weight
    torch.testing.assert_close(two_requests(packed), two_requests(plain), rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("ODMA_CPU_LINEAR", "torch")
    assert pack_linears(load_model(folder)) == 0


@onednn
def test_the_mode_decides_which_gemm_serves_large_steps(tmp_path, monkeypatch):
    folder = make_tiny_model(tmp_path / "m", "llama")
    for mode, dense_above in (("onednn", None), ("mixed", DENSE_ABOVE)):
        monkeypatch.setenv("ODMA_CPU_LINEAR", mode)
        model = load_model(folder)
        assert pack_linears(model) > 0
        assert {m.dense_above for m in model.modules() if isinstance(m, PackedLinear)} == {dense_above}


def test_an_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv("ODMA_CPU_LINEAR", "onednnn")
    with pytest.raises(ConfigError, match="ODMA_CPU_LINEAR"):
        linear_mode()
    monkeypatch.setenv("ODMA_CPU_LINEAR", "Mixed")
    assert linear_mode() == "mixed"


@per_isa
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows,k,n", [(1, 5, 3), (4, 33, 24), (5, 33, 25), (7, 96, 200), (8, 33, 48), (9, 33, 49),
                                      (16, 576, 97), (17, 64, 47), (600, 40, 100), (0, 8, 8)])
def test_kernel_matches_a_float64_reference_at_every_tail(kernel, rows, k, n, bias):
    # rows: a single one, one row pass (AVX2 4, AVX-512 8) and a pass more; columns: below, at and above one panel
    # (AVX2 24, AVX-512 48)
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(rows, k, generator=g)
    out = kernel(x, kernel.pack(w), b if bias else None, n)
    ref = F.linear(x.double(), w.double(), b.double() if bias else None)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * k ** 0.5)


@per_isa
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows,k,n", [(1, 6, 3), (5, 34, 25), (9, 96, 49), (16, 576, 97), (600, 40, 100)])
def test_bf16_kernel_matches_a_float64_reference_up_to_bf16_rounding(kernel, rows, k, n, bias):
    # AVX512_BF16's dot products where the CPU has them, bf16 widened to fp32 in registers elsewhere (kernel.bf16)
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w, b, x = (torch.randn(*shape, generator=g).bfloat16() for shape in ((n, k), (n,), (rows, k)))
    out = kernel(x, kernel.pack(w), b if bias else None, n)
    ref = F.linear(x.double(), w.double(), b.double() if bias else None)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    # products exact in fp32, sums in fp32, one rounding to bf16 at the end (2^-8 relative)
    torch.testing.assert_close(out.double(), ref, rtol=2 ** -8, atol=1e-4 * k)


@per_isa
def test_an_odd_depth_in_bf16_stays_with_another_gemm(kernel):
    assert not kernel.serves(torch.zeros(4, 7, dtype=torch.bfloat16))  # k pairs: K must be even
    assert not kernel.serves(torch.zeros(4, 8, dtype=torch.float16))
    assert kernel.serves(torch.zeros(4, 7))


@per_isa
def test_kernel_reads_strided_rows_and_leading_dimensions(kernel):
    g = torch.Generator().manual_seed(3)
    w, wide = torch.randn(50, 32, generator=g), torch.randn(2, 5, 40, generator=g)
    x = wide[..., 4:36]  # rows 40 floats apart, K = 32
    out = kernel(x, kernel.pack(w), None, 50)
    assert out.shape == (2, 5, 50)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)


@per_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_splits_panels_over_threads_without_changing_a_bit(kernel, dtype):
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(500, 70, generator=g).to(dtype), torch.randn(13, 70, generator=g).to(dtype)
    packed = kernel.pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x, packed, None, 500)
        torch.set_num_threads(3)
        three = kernel(x, packed, None, 500)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(three, one, rtol=0, atol=0)  # threads own whole panels: same sums, same order


@pytest.mark.skipif(len(KERNELS) < 2, reason="one instruction set runs here")
def test_the_avx512_and_avx2_paths_give_the_same_fp32_bits():
    g = torch.Generator().manual_seed(5)
    w, x, b = torch.randn(130, 77, generator=g), torch.randn(11, 77, generator=g), torch.randn(130, generator=g)
    outs = [k(x, k.pack(w), b, 130) for k in KERNELS.values()]  # panels of 48 and of 24 columns
    assert KERNELS["avx512"].panel != KERNELS["avx2"].panel
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)  # each output: its K products in k order


@per_isa
def test_the_default_mode_gives_fp32_layers_to_the_kernel_and_keeps_outputs(kernel, tmp_path, monkeypatch):
    monkeypatch.delenv("ODMA_CPU_LINEAR", raising=False)
    folder = make_tiny_model(tmp_path / "m", "llama")
    plain, packed = load_model(folder), load_model(folder)
    n = pack_linears(packed, kernel)
    assert n == sum(type(m) is nn.Linear for m in plain.modules()) and n > 0
    assert all(isinstance(m, KernelLinear) for m in packed_layers(packed))
    assert pack_linears(packed, kernel) == 0  # idempotent
    if plain.config.tie_word_embeddings:
        assert packed.lm_head.weight is packed.model.embed_tokens.weight
    torch.testing.assert_close(two_requests(packed), two_requests(plain), rtol=1e-4, atol=1e-4)


@per_isa
@onednn
def test_the_kernel_serves_only_where_it_can(kernel, tmp_path, monkeypatch):
    monkeypatch.delenv("ODMA_CPU_LINEAR", raising=False)
    folder = make_tiny_model(tmp_path / "m", "llama")
    bf16 = load_model(folder).to(torch.bfloat16)
    pack_linears(bf16, kernel)
    assert kernel.bf16 != "none"  # bf16 layers go to the kernel: AVX512_BF16, or widened in registers
    assert all(isinstance(m, KernelLinear) for m in packed_layers(bf16))
    for mode in ("onednn", "mixed"):  # an explicit oneDNN mode is obeyed
        monkeypatch.setenv("ODMA_CPU_LINEAR", mode)
        model = load_model(folder)
        assert pack_linears(model, kernel) > 0 and not any(isinstance(m, KernelLinear) for m in model.modules())
    monkeypatch.delenv("ODMA_CPU_LINEAR")
    monkeypatch.setattr(kernel, "parallel", False)  # a build without OpenMP would leave threads idle
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        model = load_model(folder)
        assert pack_linears(model, kernel) > 0 and not any(isinstance(m, KernelLinear) for m in model.modules())
    finally:
        torch.set_num_threads(before)


@per_isa
def test_a_bf16_model_through_the_kernel_keeps_its_outputs(kernel, tmp_path, monkeypatch):
    monkeypatch.delenv("ODMA_CPU_LINEAR", raising=False)
    folder = make_tiny_model(tmp_path / "m", "llama")
    plain, packed = load_model(folder).to(torch.bfloat16), load_model(folder).to(torch.bfloat16)
    assert pack_linears(packed, kernel) == sum(type(m) is nn.Linear for m in plain.modules())
    # both round every layer's output to bf16, in other orders: a few bf16 ulps apart
    torch.testing.assert_close(two_requests(packed).float(), two_requests(plain).float(), rtol=3e-2, atol=3e-2)


@per_isa
@onednn
def test_on_several_threads_large_steps_go_to_onednn(kernel, monkeypatch):
    monkeypatch.delenv("ODMA_CPU_LINEAR", raising=False)
    torch.manual_seed(0)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            model = nn.Sequential(nn.Linear(64, 100))
            pack_linears(model, kernel)
            layer = model[0]
            assert isinstance(layer, KernelLinear) and (layer.large is not None) == (threads > 1)
            for rows in (LARGE_ROWS, LARGE_ROWS + 1):
                x = torch.randn(rows, 64)
                torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
            if layer.large is not None:  # the split is by rows: the large path really is oneDNN's
                calls = []
                monkeypatch.setattr(layer.large, "forward", lambda x: calls.append(len(x)) or F.linear(x, layer.weight))
                layer(torch.randn(LARGE_ROWS + 1, 64)), layer(torch.randn(LARGE_ROWS, 64))
                assert calls == [LARGE_ROWS + 1]
    finally:
        torch.set_num_threads(before)
