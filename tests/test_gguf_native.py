"""Native GGUF weights (odma/models/gguf.py): a GGUF file read block by block computes what transformers'
dequantized fp32 reading of the same file computes, bit for bit through odma's kernels on one thread (llama's q/k
rows unpermuted, fused layers whose parts differ in type, a tied quantized LM head, float matrices beside quantized
ones); --weights picks native only where it can and says why not. Once per instruction set this CPU runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from backends import ckernels, cpu_linear, cpu_quant
from odma.errors import ConfigError
from odma.models.config import ModelConfig
from odma.models.cpu_linear import pack_linears
from odma.models.gguf import load_native_model, weight_bytes
from odma.models.llama import CausalLM, SeqSlot
from odma.models.quantized import QuantEmbedding, QuantLinear
from odma.models.tiny import make_tiny_gguf, make_tiny_model
from odma.models.weights import choose_weights

pytest.importorskip("gguf")
KERNELS = {}
for _isa in ckernels.ISAS:
    if ckernels.isa_runs_here(_isa) and cpu_quant.load(_isa) is not None and cpu_linear.load(_isa) is not None:
        KERNELS.setdefault(cpu_quant.load(_isa).isa, (cpu_quant.load(_isa), cpu_linear.load(_isa)))
per_isa = pytest.mark.parametrize("kernels", list(KERNELS.values()), ids=list(KERNELS))
K_QUANTS = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
            "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q6_K", "output": "F32"}
CASES = {
    "llama-Q4_1": ("llama", {}, {}),
    "llama-tied-Q4_0-Q8_0": ("llama", {"output": None, **{r: "Q4_0" for r in ("attn_q", "attn_k", "attn_output", "ffn_up")}}, {}),
    "qwen2-Q4_K-Q6_K-F32": ("qwen2", K_QUANTS, {"hidden_size": 256, "intermediate_size": 512}),
}


def dense_from_transformers(folder, file) -> CausalLM:
    """transformers' dequantized fp32 reading of the file, in odma's layers (what `--weights f32` serves)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=file, dtype=torch.float32)
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    with torch.device("meta"):
        model = CausalLM(config)
    model.load_hf_state(hf.state_dict(), dtype=torch.float32, device="cpu")
    return model.eval()


def steps(model: CausalLM) -> list[torch.Tensor]:
    """Logits of a prefill step of two requests, then three decode steps of both (greedy)."""
    c = model.config
    blocks = [torch.zeros(c.num_layers, 2, 32, c.num_kv_heads, c.head_dim) for _ in range(2)]
    out = [model(torch.tensor([3, 4, 5, 6, 7]), torch.tensor([0, 1, 2, 0, 1]),
                 [SeqSlot(blocks[0], 0, 3), SeqSlot(blocks[1], 0, 2)])]
    lens = [3, 2]
    for _ in range(3):
        ids = out[-1].argmax(-1)
        out.append(model(ids, torch.tensor(lens), [SeqSlot(b, n, 1) for b, n in zip(blocks, lens)]))
        lens = [n + 1 for n in lens]
    return out


@per_isa
@pytest.mark.parametrize("case", list(CASES))
def test_native_weights_compute_the_dequantized_fp32_models_bits(case, kernels, tmp_path):
    arch, types, shape = CASES[case]
    q, f = kernels
    path = make_tiny_gguf(tmp_path / "m.gguf", arch, types, **shape)
    dense = dense_from_transformers(tmp_path, "m.gguf")
    native = load_native_model(path, dense.config, q)
    quantized = [m for m in native.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 4 * dense.config.num_layers + (types.get("output", "Q8_0") not in ("F32",))
    assert isinstance(native.model.embed_tokens, QuantEmbedding)
    if case.startswith("qwen2"):  # q, k Q4_K beside v Q6_K: two parts of one layer; the F32 head stays a float layer
        assert [len(m.parts) for m in quantized[:1]] == [2] and type(native.lm_head) is nn.Linear
    before, activations = torch.get_num_threads(), q.activations
    try:
        torch.set_num_threads(1)  # one thread: every fp32 layer through odma's kernel (no oneDNN for large steps)
        q.activations = "f32"  # fp32 activations: the dequantized model's bits (int8 ones: test_cpu_quant.py)
        pack_linears(dense, f, mode="odma")
        pack_linears(native, f, mode="odma")  # float layers of the native model (an F32 head), if any
        assert not any(type(m) is nn.Linear for m in [*dense.modules(), *native.modules()])
        for a, b in zip(steps(native), steps(dense)):
            assert torch.equal(a, b)
    finally:
        torch.set_num_threads(before)
        q.activations = activations
    assert weight_bytes(native) < weight_bytes(dense) / 2


def test_the_weights_flag_picks_native_only_where_it_can(tmp_path):
    folder = make_tiny_model(tmp_path / "hf", "llama")
    gguf = make_tiny_gguf(tmp_path / "q.gguf")
    floats = make_tiny_gguf(tmp_path / "f.gguf", types={r: "F32" for r in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                           "ffn_gate", "ffn_up", "ffn_down",
                                                                           "token_embd", "output")})
    has_kernel = cpu_quant.load() is not None
    assert choose_weights(str(gguf), "auto", "float32", "cpu") == ("native" if has_kernel else "dense")
    assert choose_weights(str(gguf), "f32", "float32", "cpu") == "dense"
    assert choose_weights(str(gguf), "auto", "bfloat16", "cpu") == "dense"  # a dtype asked for: dense
    assert choose_weights(str(floats), "auto", "float32", "cpu") == "dense"  # nothing quantized
    assert choose_weights(str(folder), "auto", "float32", "cpu") == "dense"
    for spec, device, reason in ((str(folder), "cpu", "is not a GGUF file"), (str(gguf), "cuda", "runs on the CPU"),
                                 (str(floats), "cpu", "holds no matrix in a block type")):
        with pytest.raises(ConfigError, match=reason):
            choose_weights(spec, "native", "float32", device)
    with pytest.raises(ConfigError, match="weights must be one of"):
        choose_weights(str(gguf), "int4", "float32", "cpu")


def test_an_instruction_set_the_cpu_lacks_stops_the_start_in_words(tmp_path, monkeypatch):
    from backends import ckernels

    gguf = make_tiny_gguf(tmp_path / "q.gguf")
    monkeypatch.setenv("ODMA_CPU_ISA", "avx2")
    monkeypatch.setattr(ckernels, "cpu_flags", lambda: {"sse4_2"})
    with pytest.raises(ConfigError, match="lacks avx2"):
        choose_weights(str(gguf), "auto", "float32", "cpu")


def test_engine_config_and_cli_keep_weights_and_dtype_consistent():
    from odma.engine.config import EngineConfig
    from odma.server.cli import build_parser, config_from_args

    parse = lambda *a: config_from_args(build_parser().parse_args(list(a)))  # noqa: E731
    assert (parse().weights, parse().dtype) == ("auto", "float32")
    assert (parse("--dtype", "float32").weights, parse("--dtype", "bfloat16").weights) == ("f32", "bf16")
    assert (parse("--weights", "bf16").dtype, parse("--weights", "native").dtype) == ("bfloat16", "float32")
    for weights, dtype in (("native", "bfloat16"), ("f32", "bfloat16"), ("bf16", "float32")):
        with pytest.raises(ConfigError, match="compute in"):
            EngineConfig(weights=weights, dtype=dtype)
    with pytest.raises(ConfigError, match="compute in"):
        parse("--weights", "native", "--dtype", "bfloat16")


def test_q8_0_embedding_rows_are_gguf_pys_dequantization_bit_for_bit():
    """The embedding's Q8_0 path (torch, no per-call numpy split) against gguf-py on random blocks and ids."""
    from gguf import GGMLQuantizationType, dequantize

    gen = np.random.default_rng(0)
    vocab, dim = 50, 96
    blocks = gen.integers(0, 256, size=(vocab, dim // 32, 34), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(gen.uniform(-0.1, 0.1, vocab * dim // 32).astype(np.float16).tobytes(),
                                     dtype=np.uint8).reshape(vocab, dim // 32, 2)
    raw = blocks.reshape(vocab, -1)
    emb = QuantEmbedding(raw, int(GGMLQuantizationType.Q8_0), dim)
    ids = torch.tensor([[3, 0, 49], [7, 7, 12]])
    want = dequantize(raw[ids.flatten().numpy()], GGMLQuantizationType.Q8_0).reshape(2, 3, dim)
    assert torch.equal(emb(ids), torch.from_numpy(want))
