"""A GGUF of a real model's shape with random weights, for timing engines on real shapes where no such model can be
downloaded: Llama-3.2-1B's layers (hidden 2048, 16 layers, 32 query and 8 KV heads, MLP 8192) in Q4_K_M's types
(Q4_K; Q6_K for v, down and the LM head: in every layer, where llama-quantize's Q4_K_M gives about half the layers'
v and down Q6_K) and SmolLM2's tokenizer (an engine needs one; odma and llama.cpp both load
the file). The weights mean nothing: speeds only.

    .venv/bin/python scripts/random_gguf.py OUT.gguf [--tokenizer-from SmolLM2.gguf] [--layers 16]
"""

from __future__ import annotations

import argparse
from typing import Callable

import gguf

from odma.models.tiny import make_tiny_gguf

Q4_K_M = {**{role: "Q4_K" for role in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "token_embd")},
          **{role: "Q6_K" for role in ("attn_v", "ffn_down", "output")}}
LLAMA_3_2_1B = dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                    rope_theta=500000.0, eps=1e-5)


def strings(reader: gguf.GGUFReader, key: str) -> list[str]:
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def tokenizer_of(source: str) -> tuple[int, Callable[[gguf.GGUFWriter], None]]:
    """`source`'s BPE tokenizer: its vocabulary size, and a function that writes it into a GGUFWriter."""
    reader = gguf.GGUFReader(source)
    tokens, merges = strings(reader, "tokenizer.ggml.tokens"), strings(reader, "tokenizer.ggml.merges")
    kinds = reader.fields["tokenizer.ggml.token_type"]
    token_types = [int(kinds.parts[i][0]) for i in kinds.data]

    def scalar(key: str) -> int | None:
        field = reader.fields.get(key)
        return None if field is None else int(field.parts[field.data[0]][0])

    def write(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        if "tokenizer.ggml.pre" in reader.fields:
            w.add_tokenizer_pre(strings(reader, "tokenizer.ggml.pre")[0])
        w.add_token_list(tokens)
        w.add_token_types(token_types)
        w.add_token_merges(merges)
        for key, add in (("tokenizer.ggml.bos_token_id", w.add_bos_token_id),
                         ("tokenizer.ggml.eos_token_id", w.add_eos_token_id)):
            if (value := scalar(key)) is not None:
                add(value)
        if "tokenizer.chat_template" in reader.fields:
            w.add_chat_template(strings(reader, "tokenizer.chat_template")[0])

    return len(tokens), write


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--tokenizer-from", default="/work/llamacpp/models/SmolLM2-135M-Instruct.F32.gguf",
                   help="a GGUF whose BPE tokenizer the file gets")
    p.add_argument("--layers", type=int, default=LLAMA_3_2_1B["num_layers"])
    args = p.parse_args()
    vocab, tokenizer = tokenizer_of(args.tokenizer_from)
    make_tiny_gguf(args.out, "llama", Q4_K_M, metadata=tokenizer, vocab_size=vocab,
                   **{**LLAMA_3_2_1B, "num_layers": args.layers})
    print(args.out)


if __name__ == "__main__":
    main()
