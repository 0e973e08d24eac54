"""Random-weight models of real shapes, for timing engines on real sizes where no such model can be downloaded: the
same weights as GGUF files that odma and llama.cpp load and as a bf16 Hugging Face folder that vLLM loads.

Shapes: Llama-3.2-1B (hidden 2048, 16 layers, 32 query / 8 KV heads, MLP 8192, tied embeddings), Llama-3.2-3B
(3072, 28 layers, 24 / 8 heads, MLP 8192, tied) and Llama-3.1-8B (4096, 32 layers, 32 / 8 heads, MLP 14336, its own
LM head); the vocabulary is the tokenizer's (SmolLM2's 49,152 by default: an engine needs a tokenizer and no Llama-3
one can be downloaded here, so the embeddings and LM head are 49,152 rows, not Llama-3's 128,256).

Files, under OUT_DIR:
- SHAPE.Q4_K_M.gguf: llama-quantize's Q4_K_M types (Q4_K; Q6_K for v, down and the LM head, the tied embeddings
  included: in every layer, where llama-quantize gives about half the layers' v and down Q6_K), random blocks with
  small scales;
- SHAPE.Q4_0.gguf: the same weights requantized to Q4_0 (Q6_K stays, as `llama-quantize --allow-requantize ...
  Q4_0` keeps the LM head Q6_K);
- SHAPE-bf16/: the Q4_K_M file dequantized (q and k rows back in transformers' order) and rounded to bf16, as
  model.safetensors + a LlamaForCausalLM config.json + the tokenizer's files: vLLM runs the weights odma and
  llama.cpp run (norms are drawn on bf16 values, so they are equal exactly; the matrices up to bf16 rounding).
Every tensor is generated, converted and written one at a time (the 8B folder is ~16 GB; the machine's RAM is not).
The weights mean nothing: speeds and memory only.

    .venv/bin/python scripts/random_gguf.py OUT_DIR --shape llama-3.2-3b [--quants Q4_K_M,Q4_0] [--no-hf]
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import gguf
import numpy as np
from gguf import GGMLQuantizationType as G


@dataclass(frozen=True, slots=True)
class Shape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    tied: bool  # the LM head is the embedding matrix (no output.weight / lm_head.weight)
    rope_theta: float = 500000.0
    eps: float = 1e-5
    context_length: int = 8192  # Llama-3's 131,072 needs its rope scaling, which timing short prompts does not

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


SHAPES = {
    "llama-3.2-1b": Shape(2048, 8192, 16, 32, 8, tied=True),
    "llama-3.2-3b": Shape(3072, 8192, 28, 24, 8, tied=True),
    "llama-3.1-8b": Shape(4096, 14336, 32, 32, 8, tied=False),
}
_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd", "output")
# a role's block type per llama-quantize file type; token_embd of a tied model is the LM head, quantized as output
QUANTS = {
    "Q4_K_M": {**{r: "Q4_K" for r in _MATRICES}, "attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"},
    "Q4_0": {**{r: "Q4_0" for r in _MATRICES}, "output": "Q6_K"},
}
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


@dataclass(frozen=True, slots=True)
class TensorPlan:
    name: str  # GGUF name
    role: str  # a key of QUANTS' maps, or "norm"
    rows: int
    cols: int  # 0 for a norm (a vector)
    heads: int = 0  # q and k: llama.cpp's converter permutes their rows per head


def plan(shape: Shape, vocab: int) -> list[TensorPlan]:
    """Every tensor of the model, in the order the files hold them."""
    h, inter, hd = shape.hidden_size, shape.intermediate_size, shape.head_dim
    out = [TensorPlan("token_embd.weight", "token_embd", vocab, h)]
    if not shape.tied:
        out.append(TensorPlan("output.weight", "output", vocab, h))
    out.append(TensorPlan("output_norm.weight", "norm", h, 0))
    for i in range(shape.num_layers):
        p = f"blk.{i}."
        out += [TensorPlan(p + "attn_q.weight", "attn_q", shape.num_heads * hd, h, shape.num_heads),
                TensorPlan(p + "attn_k.weight", "attn_k", shape.num_kv_heads * hd, h, shape.num_kv_heads),
                TensorPlan(p + "attn_v.weight", "attn_v", shape.num_kv_heads * hd, h),
                TensorPlan(p + "attn_output.weight", "attn_output", h, shape.num_heads * hd),
                TensorPlan(p + "ffn_gate.weight", "ffn_gate", inter, h),
                TensorPlan(p + "ffn_up.weight", "ffn_up", inter, h),
                TensorPlan(p + "ffn_down.weight", "ffn_down", h, inter),
                TensorPlan(p + "attn_norm.weight", "norm", h, 0),
                TensorPlan(p + "ffn_norm.weight", "norm", h, 0)]
    return out


def block_type(t: TensorPlan, quant: str, tied: bool) -> str:
    if t.role == "norm":
        return "F32"
    return QUANTS[quant]["output" if t.role == "token_embd" and tied else t.role]


def random_tensor(t: TensorPlan, kind: str, seed: int, index: int) -> np.ndarray:
    """Tensor `index`'s data: a norm's fp32 values (bf16-exact, around 1), or random blocks of `kind` whose fp16
    scales keep the weights around 0.05 (Q4_K: w = d*sc*q - dmin*m; Q6_K: w = d*sc*(q - 32))."""
    rng = np.random.default_rng([seed, index])
    if t.role == "norm":
        values = (1 + 0.1 * rng.standard_normal(t.rows)).astype(np.float32)
        return (values.view(np.uint32) & 0xFFFF0000).view(np.float32)  # bf16-exact: vLLM's copy equals it
    size = {"Q4_K": 144, "Q6_K": 210}[kind]
    raw = rng.integers(0, 256, size=(t.rows, t.cols // 256, size), dtype=np.uint8)
    half = lambda v: np.full((t.rows, t.cols // 256, 1), v, np.float16).view(np.uint8)  # noqa: E731
    if kind == "Q4_K":
        raw[..., 0:2], raw[..., 2:4] = half(0.0004), half(0.0004)
    else:
        raw[..., 208:210] = half(0.00002)
    return raw.reshape(t.rows, -1)


def _stream_gguf(path: Path, shape: Shape, vocab: int, quant: str, tokenizer: Callable[[gguf.GGUFWriter], None],
                 tensors: Iterator[np.ndarray], tensor_plan: list[TensorPlan]) -> None:
    """Write a GGUF whose tensor infos are known up front and whose data arrive one tensor at a time."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(shape.context_length), w.add_block_count(shape.num_layers)
    w.add_embedding_length(shape.hidden_size), w.add_feed_forward_length(shape.intermediate_size)
    w.add_head_count(shape.num_heads), w.add_head_count_kv(shape.num_kv_heads)
    w.add_rope_freq_base(shape.rope_theta), w.add_layer_norm_rms_eps(shape.eps), w.add_vocab_size(vocab)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_file_type({"Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[quant])
    tokenizer(w)
    for t in tensor_plan:
        kind = block_type(t, quant, shape.tied)
        if kind == "F32":
            w.add_tensor_info(t.name, (t.rows,), np.dtype(np.float32), t.rows * 4)
        else:
            size, block = gguf.GGML_QUANT_SIZES[G[kind]][1], gguf.GGML_QUANT_SIZES[G[kind]][0]
            nbytes = t.rows * t.cols // block * size
            w.add_tensor_info(t.name, (t.rows, t.cols // block * size), np.dtype(np.uint8), nbytes, raw_dtype=G[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for data in tensors:
        w.write_tensor_data(data)
    w.close()


def write_random(path: Path, shape: Shape, vocab: int, tokenizer, seed: int = 0) -> Path:
    """The Q4_K_M file: every tensor drawn from (seed, its index), so the file is the same on every run."""
    tensor_plan = plan(shape, vocab)
    data = (random_tensor(t, block_type(t, "Q4_K_M", shape.tied), seed, i) for i, t in enumerate(tensor_plan))
    _stream_gguf(path, shape, vocab, "Q4_K_M", tokenizer, data, tensor_plan)
    return path


def requantize(source: Path, path: Path, shape: Shape, vocab: int, quant: str, tokenizer) -> Path:
    """`source`'s weights in `quant`'s types: a tensor whose type changes is dequantized and quantized again
    (gguf-py's reference quantizer), one that keeps its type is copied."""
    reader = gguf.GGUFReader(str(source))
    by_name = {t.name: t for t in reader.tensors}
    tensor_plan = plan(shape, vocab)

    def data() -> Iterator[np.ndarray]:
        for t in tensor_plan:
            src, kind = by_name[t.name], block_type(t, quant, shape.tied)
            if src.tensor_type.name == kind or kind == "F32":
                yield np.array(src.data)
            else:
                floats = gguf.dequantize(src.data, src.tensor_type)
                yield gguf.quantize(floats, G[kind])

    _stream_gguf(path, shape, vocab, quant, tokenizer, data(), tensor_plan)
    return path


def _unpermute(m: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's converter permutation of q / k rows (GGUF order → transformers' order)."""
    return m.reshape(heads, m.shape[0] // heads // 2, 2, *m.shape[1:]).swapaxes(1, 2).reshape(m.shape)


def hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, role, _ = name.split(".")
    return f"model.layers.{layer}.{HF_NAMES[role]}.weight"


def _bf16_bytes(values: np.ndarray) -> bytes:
    import torch

    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16).view(
        torch.int16).numpy().tobytes()


def write_hf_bf16(source: Path, folder: Path, shape: Shape, vocab: int, tokenizer_folder: Path,
                  bos: int | None, eos: int | None) -> Path:
    """`source` (a GGUF of `shape`) dequantized to a bf16 LlamaForCausalLM folder: one model.safetensors written
    tensor by tensor (header first: every shape is known), config.json, and the tokenizer files of
    `tokenizer_folder`. Written into a temporary folder and renamed, so a folder that exists is complete."""
    reader = gguf.GGUFReader(str(source))
    by_name = {t.name: t for t in reader.tensors}
    tensor_plan = plan(shape, vocab)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensor_plan:
        dims = [t.rows, t.cols] if t.cols else [t.rows]
        nbytes = 2 * t.rows * max(t.cols, 1)
        header[hf_name(t.name)] = {"dtype": "BF16", "shape": dims, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for t in tensor_plan:
            src = by_name[t.name]
            values = np.array(src.data, dtype=np.float32) if src.tensor_type == G.F32 else \
                gguf.dequantize(src.data, src.tensor_type)
            values = values.reshape(t.rows, t.cols) if t.cols else values.reshape(t.rows)
            if t.heads:
                values = _unpermute(values, t.heads)
            f.write(_bf16_bytes(values))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size, "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim, "hidden_act": "silu", "rms_norm_eps": shape.eps, "rope_theta": shape.rope_theta,
        "max_position_embeddings": shape.context_length, "vocab_size": vocab, "tie_word_embeddings": shape.tied,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16", "bos_token_id": bos,
        "eos_token_id": eos,
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (tokenizer_folder / name).exists():
            shutil.copy(tokenizer_folder / name, tmp / name)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def strings(reader: gguf.GGUFReader, key: str) -> list[str]:
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def tokenizer_of(source: str) -> tuple[int, Callable[[gguf.GGUFWriter], None], dict]:
    """`source`'s BPE tokenizer: its vocabulary size, a function that writes it into a GGUFWriter, and its
    special token ids ({"bos": .., "eos": ..}, None where absent)."""
    reader = gguf.GGUFReader(source)
    tokens, merges = strings(reader, "tokenizer.ggml.tokens"), strings(reader, "tokenizer.ggml.merges")
    kinds = reader.fields["tokenizer.ggml.token_type"]
    token_types = [int(kinds.parts[i][0]) for i in kinds.data]

    def scalar(key: str) -> int | None:
        field = reader.fields.get(key)
        return None if field is None else int(field.parts[field.data[0]][0])

    special = {"bos": scalar("tokenizer.ggml.bos_token_id"), "eos": scalar("tokenizer.ggml.eos_token_id")}
    pre = strings(reader, "tokenizer.ggml.pre")[0] if "tokenizer.ggml.pre" in reader.fields else None
    template = strings(reader, "tokenizer.chat_template")[0] if "tokenizer.chat_template" in reader.fields else None

    def write(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        if pre is not None:
            w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(token_types)
        w.add_token_merges(merges)
        if special["bos"] is not None:
            w.add_bos_token_id(special["bos"])
        if special["eos"] is not None:
            w.add_eos_token_id(special["eos"])
        if template is not None:
            w.add_chat_template(template)

    return len(tokens), write, special


def build(out_dir: Path, name: str, shape: Shape, tokenizer_gguf: str, quants: list[str], hf: bool,
          seed: int = 0) -> dict[str, Path]:
    """The files of `shape` under `out_dir` (see the module's docstring); an existing file is kept. Returns
    {"Q4_K_M": path, "Q4_0": path, "hf": folder} for what was asked."""
    from odma.models.weights import resolve_model

    bad = set(quants) - set(QUANTS)
    if bad:
        raise SystemExit(f"unknown quant types {sorted(bad)}: choose from {', '.join(QUANTS)}")
    if shape.hidden_size % 256 or shape.intermediate_size % 256:
        raise SystemExit("K-quant blocks need hidden and MLP sizes that are multiples of 256")
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab, tokenizer, special = tokenizer_of(tokenizer_gguf)
    made: dict[str, Path] = {}
    source = out_dir / f"{name}.Q4_K_M.gguf"  # every other file is made from it
    if not source.exists():
        _timed(f"write {source}", lambda: _atomic(source, lambda tmp: write_random(tmp, shape, vocab, tokenizer, seed)))
    if "Q4_K_M" in quants:
        made["Q4_K_M"] = source
    for quant in (q for q in quants if q != "Q4_K_M"):
        path = made[quant] = out_dir / f"{name}.{quant}.gguf"
        if not path.exists():
            _timed(f"write {path}", lambda: _atomic(path, lambda tmp: requantize(source, tmp, shape, vocab, quant,
                                                                               tokenizer)))
    if hf:
        folder = made["hf"] = out_dir / f"{name}-bf16"
        if not (folder / "config.json").exists():
            tok_folder = resolve_model(tokenizer_gguf, weights=False)
            _timed(f"write {folder}", lambda: write_hf_bf16(source, folder, shape, vocab, tok_folder,
                                                            special["bos"], special["eos"]))
    return made


def _atomic(path: Path, write: Callable[[Path], Path]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    tmp.rename(path)


def _timed(what: str, fn: Callable[[], object]) -> None:
    t0 = time.perf_counter()
    fn()
    print(f"{what}: {time.perf_counter() - t0:.0f} s", flush=True)


def main() -> None:
    from odma.models.weights import gguf_file

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path, help="where the files go (the 8B folder needs ~16 GB, its GGUFs ~10 GB)")
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--quants", default="Q4_K_M,Q4_0", help=f"GGUF files to write, from {','.join(QUANTS)}")
    p.add_argument("--no-hf", action="store_true", help="no bf16 folder for vLLM")
    p.add_argument("--tokenizer-from", default=None,
                   help="a GGUF whose BPE tokenizer the files get (default: SmolLM2-135M-Instruct's)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (a quick file)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    shape = SHAPES[args.shape]
    name = args.shape
    if args.layers is not None:
        from dataclasses import replace

        shape, name = replace(shape, num_layers=args.layers), f"{args.shape}-{args.layers}l"
    made = build(args.out_dir, name, shape, args.tokenizer_from or str(gguf_file("smollm2")),
                 [q.strip() for q in args.quants.split(",") if q.strip()], not args.no_hf, args.seed)
    for kind, path in made.items():
        print(f"{kind}: {path}")


if __name__ == "__main__":
    main()
