"""oneDNN-packed linear layers (odma/models/cpu_linear.py): same results as F.linear up to summation order, on
both sides of the row threshold; packing a model is idempotent, keeps a tied LM head tied, and can be turned off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from odma.errors import ConfigError
from odma.models import load_model
from odma.models.cpu_linear import (DENSE_ABOVE, PackedLinear, linear_mode, onednn_linear_available, pack_linears,
                                    packable_dtypes)
from odma.models.llama import SeqSlot
from odma.models.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="torch built without mkldnn")


@pytest.mark.parametrize("dense_above", [None, 512])
@pytest.mark.parametrize("rows", [1, 7, 64, 600])
def test_packed_linear_matches_f_linear(rows, dense_above):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=True)
    packed = PackedLinear(lin, dense_above=dense_above)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


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


def test_a_bf16_model_is_packed_where_onednn_has_bf16(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "llama")
    model = load_model(folder).to(torch.bfloat16)
    n = pack_linears(model)
    linears = sum(type(m) is nn.Linear for m in load_model(folder).modules())
    assert n == (linears if torch.bfloat16 in packable_dtypes() else 0)


def test_packing_a_model_keeps_its_outputs_and_tied_head(tmp_path, monkeypatch):
    folder = make_tiny_model(tmp_path / "m", "llama")
    plain, packed = load_model(folder), load_model(folder)
    n = pack_linears(packed)
    assert n == sum(type(m) is nn.Linear for m in plain.modules()) and n > 0
    assert pack_linears(packed) == 0  # idempotent
    assert packed.dtype == torch.float32
    if plain.config.tie_word_embeddings:
        assert packed.lm_head.weight is packed.model.embed_tokens.weight
    c = plain.config
    arenas = [torch.zeros(c.num_layers, 2, 32, c.num_kv_heads, c.head_dim) for _ in range(2)]
    ids, pos = torch.tensor([3, 4, 5, 6, 7]), torch.tensor([0, 1, 2, 0, 1])
    outs = []
    for model in (plain, packed):
        seqs = [SeqSlot(arenas[0].clone(), 0, 3), SeqSlot(arenas[1].clone(), 0, 2)]
        outs.append(model(ids, pos, seqs))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("ODMA_CPU_LINEAR", "torch")
    assert pack_linears(load_model(folder)) == 0


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
