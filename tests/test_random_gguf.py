"""scripts/random_gguf.py: the real shapes hold the real models' parameter counts; the files of a tiny shape load in
odma, and the bf16 folder for vLLM holds the Q4_K_M file's weights (transformers' own reading of that file, rounded
to bf16) and computes what odma computes on the file."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("random_gguf", ROOT / "scripts" / "random_gguf.py")
rg = sys.modules["random_gguf"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(rg)


@pytest.mark.parametrize("name, params", [("llama-3.2-1b", 1_235_814_400), ("llama-3.2-3b", 3_212_749_824),
                                          ("llama-3.1-8b", 8_030_261_248)])
def test_the_shapes_have_the_real_models_parameter_counts(name, params):
    # with Llama-3's vocabulary (128,256) the plan counts what the published checkpoints hold
    plan = rg.plan(rg.SHAPES[name], 128_256)
    assert sum(t.rows * max(t.cols, 1) for t in plan) == params


def _smollm2_gguf() -> str:
    from odma.models.weights import gguf_file

    return str(gguf_file("smollm2"))


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "own-head"])
def files(request, tmp_path_factory):
    shape = rg.Shape(256, 512, 2, 4, 2, tied=request.param)
    out = tmp_path_factory.mktemp("shape")
    return shape, rg.build(out, "tiny", shape, _smollm2_gguf(), ["Q4_K_M", "Q4_0"], hf=True)


def test_the_bf16_folder_holds_the_gguf_weights_as_transformers_reads_them(files):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    shape, made = files
    gguf_path = made["Q4_K_M"]
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    theirs = hf.state_dict()
    ours = load_file(str(made["hf"] / "model.safetensors"))
    expected = set(theirs) - ({"lm_head.weight"} if shape.tied else set())
    assert set(ours) == expected
    for name, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, theirs[name].to(torch.bfloat16)), name
    config = json.loads((made["hf"] / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "tie_word_embeddings"):
        assert config[key] == getattr(hf.config, key), key
    assert config["architectures"] == ["LlamaForCausalLM"] and (made["hf"] / "tokenizer.json").exists()


def _logits(model, tokens: list[int]) -> torch.Tensor:
    from odma.models.llama import SeqSlot

    c = model.config
    block = torch.zeros(c.num_layers, 2, 16, c.num_kv_heads, c.head_dim)
    return model(torch.tensor(tokens), torch.arange(len(tokens)), [SeqSlot(block, 0, len(tokens))])


def test_odma_loads_both_files_and_the_folder_computes_the_same(files):
    from backends import ckernels, cpu_quant
    from odma.models.gguf import load_native_model
    from odma.models.weights import load_model

    shape, made = files
    isa = next((i for i in ckernels.ISAS if ckernels.isa_runs_here(i) and cpu_quant.load(i) is not None), None)
    if isa is None:
        pytest.skip("no quantized kernel builds on this CPU")
    dense = load_model(made["hf"], dtype=torch.float32)  # the bf16 values, computed in fp32
    tokens = [1, 17, 300, 4242, 9]
    reference = _logits(dense, tokens)
    for quant in ("Q4_K_M", "Q4_0"):
        native = load_native_model(made[quant], dense.config, cpu_quant.load(isa))
        logits = _logits(native, tokens)
        assert torch.isfinite(logits).all()
        cos = torch.nn.functional.cosine_similarity(logits, reference, dim=-1)
        # Q4_K_M: the same weights up to bf16 rounding; Q4_0: requantized, a coarser copy of them
        assert cos.min() > (0.999 if quant == "Q4_K_M" else 0.9), (quant, cos)


def test_the_q4_0_file_is_the_q4_k_m_weights_requantized(files):
    import gguf

    shape, made = files
    k = {t.name: t for t in gguf.GGUFReader(str(made["Q4_K_M"])).tensors}
    z = {t.name: t for t in gguf.GGUFReader(str(made["Q4_0"])).tensors}
    assert list(k) == list(z)
    for name, t in z.items():
        plan = next(p for p in rg.plan(shape, 49152) if p.name == name)
        assert t.tensor_type.name == rg.block_type(plan, "Q4_0", shape.tied), name
        if t.tensor_type.name == "Q4_0":
            a, b = gguf.dequantize(k[name].data, k[name].tensor_type), gguf.dequantize(t.data, t.tensor_type)
            assert np.abs(a - b).mean() < 0.15 * np.abs(a).mean(), name
        else:
            assert np.array_equal(np.asarray(k[name].data), np.asarray(t.data)), name
