"""The decode-step kernel (backends/cpu_step.py, csrc/decode_step.c): a step through the whole decoder in C (decode
rows, and prefill chunks' rows: row by row or tiled, as tests/test_prefill_attention.py checks) computes what the
model's Python layers compute (logits, the KV rows it writes, captured hidden states) for fp32 panels and every GGUF
block type, ragged contexts, GQA, biases and fused layers of mixed types;
bad input is refused before anything is written; models it cannot run keep their Python layers."""

from __future__ import annotations

import logging

import pytest
import torch

from backends import ckernels, cpu_attention, cpu_step
from backends.cpu import CPUBackend
from backends.errors import BackendError
from odma.models.cpu_linear import pack_linears
from odma.models.llama import HiddenCapture, SeqSlot
from odma.models.native_step import NativeLayers
from odma.models.tiny import make_tiny_gguf, random_model

from test_gguf_native import K_QUANTS, KERNELS, per_isa  # noqa: E402 (the quantized and fp32 kernels per ISA)

pytestmark = pytest.mark.skipif(ckernels.disabled(), reason="ODMA_CPU_KERNELS=0 turns the C kernels off")
CASES = {  # GGUF files (arch, types, shape), or a random model's dtype (panels of odma's kernel; GQA 3:1, head_dim 64)
    "llama-Q4_1": ("llama", {}, {}),
    "llama-Q4_0-Q8_0": ("llama", {r: "Q4_0" for r in ("attn_q", "attn_k", "attn_output", "ffn_up")}
                        | {"attn_v": "Q8_0", "ffn_down": "Q8_0"}, {}),
    "qwen2-Q4_K-Q6_K-bias": ("qwen2", K_QUANTS | {"output": "Q8_0"}, {"hidden_size": 256, "intermediate_size": 512}),
    "fp32": torch.float32,
    "bf16": torch.bfloat16,  # activations rounded where the Python layers round them: close, not equal
}
FP32_SHAPE = dict(model_type="llama", vocab_size=300, hidden_size=192, intermediate_size=320, num_layers=3,
                  num_heads=6, num_kv_heads=2, head_dim=32 * 2, rms_norm_eps=1e-5, rope_theta=10000.0,
                  max_position_embeddings=1024, tie_word_embeddings=False, qkv_bias=False, o_bias=False)
PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(10, 27))]  # ragged contexts; one decoding from its 4th row


@pytest.fixture(scope="module")
def kernel():
    k = cpu_step.load()
    assert k is not None, "the decode-step kernel did not build (test_kernel_paths names it too)"
    return k


def build(case, kernels, tmp_path):
    """The case's model, its float layers packed for odma's fp32 kernel."""
    from transformers import AutoConfig

    from odma.models.config import ModelConfig
    from odma.models.gguf import load_native_model

    quant, linear = kernels
    if isinstance(CASES[case], torch.dtype):
        model = random_model(FP32_SHAPE, dtype=CASES[case], seed=3)
        with torch.no_grad():  # norms away from 1, so that a norm read wrongly shows
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
    else:
        arch, types, shape = CASES[case]
        path = make_tiny_gguf(tmp_path / "m.gguf", arch, types, **shape)
        config = ModelConfig.from_hf_dict(AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name).to_dict())
        model = load_native_model(path, config, quant)
    pack_linears(model, linear, mode="odma")
    return model


def run_steps(model, attention, decode_steps=4, capture=None):
    """A prefill of PROMPTS, then decode steps of all three: every step's logits, the blocks, and the captured
    hidden states of the decode steps."""
    c = model.config
    blocks = [torch.zeros(c.num_layers, 2, 64, c.num_kv_heads, c.head_dim) for _ in PROMPTS]
    ids = torch.tensor([t for p in PROMPTS for t in p])
    positions = torch.tensor([i for p in PROMPTS for i in range(len(p))])
    logits = [model(ids, positions, [SeqSlot(b, 0, len(p)) for b, p in zip(blocks, PROMPTS)], attention)]
    lens, captured = [len(p) for p in PROMPTS], []
    for _ in range(decode_steps):
        hidden = HiddenCapture(capture) if capture else None
        step_ids = logits[-1].argmax(-1)
        logits.append(model(step_ids, torch.tensor(lens), [SeqSlot(b, n, 1) for b, n in zip(blocks, lens)],
                            attention, capture=hidden))
        captured.append(hidden.last if hidden else {})
        lens = [n + 1 for n in lens]
    return logits, blocks, captured


@per_isa
@pytest.mark.parametrize("case", list(CASES))
def test_a_native_decode_step_computes_what_the_python_layers_compute(case, kernels, kernel, tmp_path):
    model = build(case, kernels, tmp_path)
    if case == "bf16" and torch.bfloat16 not in kernels[1].dtypes:
        pytest.skip("this build has no bf16 GEMM")
    attention = cpu_attention.load()
    threads, activations = torch.get_num_threads(), kernels[0].activations
    try:
        torch.set_num_threads(1)
        # fp32 activations: int8 ones would turn the norms' last-bit differences into whole quantization steps
        kernels[0].activations = "f32"
        model.native_layers = None
        ref_logits, ref_blocks, ref_hidden = run_steps(model, attention, capture=(0, 1, model.config.num_layers))
        model.native_layers = NativeLayers.build(model, kernel)
        assert model.native_layers is not None
        logits, blocks, hidden = run_steps(model, attention, capture=(0, 1, model.config.num_layers))
    finally:
        torch.set_num_threads(threads)
        kernels[0].activations = activations
    # the norms' sums of squares run in another order; in bf16 (equal here) that may move a rounding by one bf16 ulp
    # in bf16 a prefill's rows of attention, summed in another order, may move a logit by a bf16 ulp (2^-8 here)
    tol = dict(rtol=1e-4, atol=1e-4) if case != "bf16" else dict(rtol=1e-2, atol=8e-3)
    for a, b in zip(logits, ref_logits):  # the prefill too: its rows each as a row of the kernel's own
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(a, b, **tol)
    for a, b in zip(blocks, ref_blocks):  # the K and V rows each step wrote, every layer
        torch.testing.assert_close(a, b, **tol)
        assert a[:, :, 45:].abs().sum() == 0  # and nothing past the last decoded row (37 + 4 rows at most)
    for step, ref in zip(hidden, ref_hidden):
        assert step.keys() == ref.keys()
        for layer in step:
            torch.testing.assert_close(step[layer], ref[layer], **tol)


@pytest.mark.parametrize("case", ["fp32", "llama-Q4_1"])
def test_decode_steps_reading_pieces_compute_what_one_block_each_computes(case, kernel, tmp_path, monkeypatch):
    """Requests whose first rows lie in other blocks (a prefix read in place, a block continued elsewhere) decode
    through the native step (not the Python layers), with the logits and K/V rows of the same requests held in one
    block each; the new rows land in their own blocks, the pieces are only read."""
    model = build(case, next(iter(KERNELS.values())), tmp_path)
    attention = cpu_attention.load()
    model.native_layers = NativeLayers.build(model, kernel)
    runs = []
    real_run = NativeLayers.run
    monkeypatch.setattr(NativeLayers, "run", lambda self, x, decode, *a, **kw: runs.append(decode.pieces is not None)
                        or real_run(self, x, decode, *a, **kw))
    _, blocks, _ = run_steps(model, attention, decode_steps=0)
    runs.clear()  # (the prefill's)
    cuts = [[10, 30], [2], []]  # a request reading two pieces, one reading one, one its own block only
    pieced, lens = [], [len(p) for p in PROMPTS]
    for block, at in zip(blocks, cuts):
        pieces, lo = [], 0
        for end in at:
            view = torch.zeros_like(block[:, :, : end - lo + 3])  # holding its rows from lo - 3 (a block's own rows)
            view[:, :, 3:] = block[:, :, lo:end]
            pieces.append((view, lo - 3, end))
            lo = end
        pieced.append((pieces or None, block[:, :, lo:].clone()))
    before = [[v.clone() for v, _, _ in pieces or ()] for pieces, _ in pieced]
    ids = torch.tensor([7, 8, 9])
    for _ in range(3):
        plain = model(ids, torch.tensor(lens), [SeqSlot(b, n, 1) for b, n in zip(blocks, lens)], attention)
        read = model(ids, torch.tensor(lens), [SeqSlot(own, n, 1, pieces=p) for (p, own), n in zip(pieced, lens)],
                     attention)
        torch.testing.assert_close(read, plain, rtol=1e-5, atol=1e-5)
        ids, lens = plain.argmax(-1), [n + 1 for n in lens]
    assert runs == [False, True] * 3  # both through the native step
    for (pieces, own), block, at, was in zip(pieced, blocks, cuts, before):
        first = at[-1] if at else 0
        torch.testing.assert_close(own[:, :, : lens[0] - first], block[:, :, first: lens[0]], rtol=1e-5, atol=1e-5)
        assert all(torch.equal(v, w) for (v, _, _), w in zip(pieces or (), was))


@pytest.mark.parametrize("case", ["fp32", "llama-Q4_1", "qwen2-Q4_K-Q6_K-bias"])
def test_a_step_mixing_decodes_and_prefill_chunks_after_cached_rows(case, kernel, tmp_path, monkeypatch):
    """One step: a request decoding, one prefilling a chunk after 20 cached rows, one prefilling from its start. The
    native kernel (every row as a row of its own) against the Python layers (SDPA for the chunks)."""
    kernels_first = next(iter(KERNELS.values()))
    model = build(case, kernels_first, tmp_path)
    attention = cpu_attention.load()
    c = model.config
    prompt = list(range(3, 40))
    threads, activations = torch.get_num_threads(), kernels_first[0].activations
    results = {}
    try:
        torch.set_num_threads(1)
        kernels_first[0].activations = "f32"
        for mode in ("decode", "native"):  # decode: steps with prefill rows through the Python layers
            monkeypatch.setenv("ODMA_CPU_STEP", mode)
            model.native_layers = NativeLayers.build(model, kernel)
            blocks = [torch.zeros(c.num_layers, 2, 64, c.num_kv_heads, c.head_dim) for _ in range(3)]
            first = [SeqSlot(blocks[0], 0, 12), SeqSlot(blocks[1], 0, 20)]  # earlier steps, the Python layers
            ids = torch.tensor(prompt[:12] + prompt[:20])
            model(ids, torch.tensor(list(range(12)) + list(range(20))), first, attention)
            slots = [SeqSlot(blocks[0], 12, 1), SeqSlot(blocks[1], 20, 17), SeqSlot(blocks[2], 0, 9)]
            ids = torch.tensor([prompt[12]] + prompt[20:37] + prompt[:9])
            positions = torch.tensor([12] + list(range(20, 37)) + list(range(9)))
            results[mode] = model(ids, positions, slots, attention), blocks
    finally:
        torch.set_num_threads(threads)
        kernels_first[0].activations = activations
    (native, native_blocks), (python, python_blocks) = results["native"], results["decode"]
    assert torch.equal(native.argmax(-1), python.argmax(-1))
    torch.testing.assert_close(native, python, rtol=1e-4, atol=1e-4)
    for a, b in zip(native_blocks, python_blocks):  # every chunk row's K and V, every layer
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert native_blocks[1][:, :, 37:].abs().sum() == 0  # nothing past the chunk's last row


def test_prefill_chunks_of_any_context_take_the_native_step(kernel, tmp_path, monkeypatch):
    """The tiled attention beats SDPA at every context measured (native_step.py), so no chunk is sent back to the
    Python layers for its length; decode-only steps are no prefill steps, and ODMA_CPU_STEP=decode keeps them all."""
    model = build("fp32", next(iter(KERNELS.values())), tmp_path)
    native = NativeLayers.build(model, kernel)
    c = model.config
    block = torch.zeros(c.num_layers, 2, 64, c.num_kv_heads, c.head_dim)
    assert native.takes_prefill([SeqSlot(block, 0, 20), SeqSlot(block, 30, 1)])
    assert native.takes_prefill([SeqSlot(block, 7936, 256)])  # a chunk ending at 8,192 tokens of context
    assert not native.takes_prefill([SeqSlot(block, 30, 1)])  # decode rows only: not a prefill step
    monkeypatch.setenv("ODMA_CPU_STEP", "decode")
    assert not NativeLayers.build(model, kernel).takes_prefill([SeqSlot(block, 0, 20)])


@per_isa
def test_the_native_step_follows_the_quantized_kernels_activations(kernels, kernel, tmp_path):
    """int8 activations set on the quantized kernel after the layers were prepared reach the native step too: its
    logits move from fp32 activations' as the Python layers' do, and stay close to theirs."""
    quant = kernels[0]
    if quant.int8 == "none":
        pytest.skip("this build has no integer dot product")
    model = build("llama-Q4_0-Q8_0", kernels, tmp_path)
    attention = cpu_attention.load()
    model.native_layers = NativeLayers.build(model, kernel)
    native_layers, activations, threads = model.native_layers, quant.activations, torch.get_num_threads()
    runs = {}
    try:
        torch.set_num_threads(1)
        for mode in ("f32", "int8"):
            quant.activations = mode
            for path in ("native", "python"):
                model.native_layers = native_layers if path == "native" else None
                runs[mode, path] = run_steps(model, attention, decode_steps=2)[0][1:]
    finally:
        torch.set_num_threads(threads)
        quant.activations = activations
    for step in range(2):
        moved = runs["int8", "native"][step] - runs["f32", "native"][step]
        assert moved.abs().max() > 1e-3  # int8 reached the native GEMMs
        torch.testing.assert_close(runs["int8", "native"][step], runs["int8", "python"][step], rtol=0.05, atol=0.05)


def test_several_threads_split_the_requests_and_give_the_same_step(kernel, tmp_path):
    model = build("fp32", next(iter(KERNELS.values())), tmp_path)
    attention = cpu_attention.load()
    model.native_layers = NativeLayers.build(model, kernel)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, one_blocks, _ = run_steps(model, attention, decode_steps=2)
        torch.set_num_threads(2)
        two, two_blocks, _ = run_steps(model, attention, decode_steps=2)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one + one_blocks, two + two_blocks):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_before_anything_is_written(kernel, tmp_path):
    model = build("fp32", next(iter(KERNELS.values())), tmp_path)
    native = NativeLayers.build(model, kernel)
    c = model.config
    block = torch.zeros(c.num_layers, 2, 8, c.num_kv_heads, c.head_dim)
    x = torch.randn(1, c.hidden_size)
    table = model.rotary.table(16)
    args = [torch.tensor([block.data_ptr()]), torch.tensor([block.stride(0)]), torch.tensor([block.stride(1)])]
    with pytest.raises(RuntimeError, match="code 1"):  # a request at no position
        kernel(native.prepared, x.clone(), *args, torch.tensor([0]), table)
    with pytest.raises(ValueError, match="rotary table"):
        kernel(native.prepared, x.clone(), *args, torch.tensor([table.shape[0] + 1]), table)
    with pytest.raises(ValueError, match="layers"):
        kernel(native.prepared, x.clone(), *args, torch.tensor([3]), table, first=1, count=c.num_layers)
    with pytest.raises(ValueError, match="int64"):
        kernel(native.prepared, x.clone(), *args, torch.tensor([3], dtype=torch.int32), table)
    assert block.abs().sum() == 0
    spec = native.prepared.specs[0]
    wrong = cpu_step.ModelShape(c.hidden_size, c.num_heads, c.num_heads, c.head_dim, c.intermediate_size, 1e-5)
    with pytest.raises(ValueError, match="qkv"):  # sizes the model's shape contradicts
        kernel.prepare(wrong, [spec])


def test_models_the_kernel_cannot_run_keep_their_python_layers(kernel, caplog):
    fp32 = random_model(FP32_SHAPE, dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="odma.models.native_step"):
        assert NativeLayers.build(fp32, kernel) is None  # F.linear layers (nothing packed)
    assert "no native GEMM" in caplog.text
    pack_linears(fp32, None, mode="onednn")  # oneDNN's packed layers: no entry point the kernel can call
    assert NativeLayers.build(fp32, kernel) is None
    assert NativeLayers.build(fp32, None) is None
    half = random_model(FP32_SHAPE, dtype=torch.float16)
    pack_linears(half, next(iter(KERNELS.values()))[1], mode="odma")
    with caplog.at_level(logging.INFO, logger="odma.models.native_step"):
        assert NativeLayers.build(half, kernel) is None
    assert "float16" in caplog.text


def test_the_switch_is_checked_and_python_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("ODMA_CPU_STEP", "nativ")
    with pytest.raises(BackendError, match="ODMA_CPU_STEP"):
        CPUBackend().decode_step()
    monkeypatch.setenv("ODMA_CPU_STEP", "python")
    assert CPUBackend().decode_step() is None
    monkeypatch.setenv("ODMA_CPU_STEP", "decode")
    assert CPUBackend().decode_step() is cpu_step.load()
    monkeypatch.setenv("ODMA_CPU_STEP", "native")
    assert CPUBackend().decode_step() is cpu_step.load()
