"""A GGUF of a real model's shape with random weights, for timing engines on real shapes where no such model can be
downloaded: Llama-3.2-1B's layers (hidden 2048, 16 layers, 32 query and 8 KV heads, MLP 8192) in Q4_K_M's types
(Q4_K; Q6_K for v, down and the LM head) and SmolLM2's tokenizer (an engine needs one; odma and llama.cpp both load
the file). The weights mean nothing: speeds only.

    .venv/bin/python scripts/random_gguf.py OUT.gguf [--tokenizer-from SmolLM2.gguf] [--layers 16]
"""

from __future__ import annotations

import argparse

import gguf

from odma.models.tiny import make_tiny_gguf

Q4_K_M = {**{role: "Q4_K" for role in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "token_embd")},
          **{role: "Q6_K" for role in ("attn_v", "ffn_down", "output")}}
LLAMA_3_2_1B = dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                    rope_theta=500000.0, eps=1e-5)


def strings(reader: gguf.GGUFReader, key: str) -> list[str]:
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def tokenizer_writer(source: str) -> type[gguf.GGUFWriter]:
    """A GGUFWriter that copies `source`'s BPE tokenizer into the file it writes."""
    reader = gguf.GGUFReader(source)
    tokens, merges = strings(reader, "tokenizer.ggml.tokens"), strings(reader, "tokenizer.ggml.merges")
    kinds = reader.fields["tokenizer.ggml.token_type"]
    token_types = [int(kinds.parts[i][0]) for i in kinds.data]

    def scalar(key: str) -> int | None:
        field = reader.fields.get(key)
        return None if field is None else int(field.parts[field.data[0]][0])

    class Writer(gguf.GGUFWriter):
        vocab_size = len(tokens)

        def write_header_to_file(self, *args, **kwargs):
            self.add_tokenizer_model("gpt2")
            if "tokenizer.ggml.pre" in reader.fields:
                self.add_tokenizer_pre(strings(reader, "tokenizer.ggml.pre")[0])
            self.add_token_list(tokens)
            self.add_token_types(token_types)
            self.add_token_merges(merges)
            for key, add in (("tokenizer.ggml.bos_token_id", self.add_bos_token_id),
                             ("tokenizer.ggml.eos_token_id", self.add_eos_token_id)):
                if (value := scalar(key)) is not None:
                    add(value)
            if "tokenizer.chat_template" in reader.fields:
                self.add_chat_template(strings(reader, "tokenizer.chat_template")[0])
            return super().write_header_to_file(*args, **kwargs)

    return Writer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--tokenizer-from", default="/work/llamacpp/models/SmolLM2-135M-Instruct.F32.gguf",
                   help="a GGUF whose BPE tokenizer the file gets")
    p.add_argument("--layers", type=int, default=LLAMA_3_2_1B["num_layers"])
    args = p.parse_args()
    writer = tokenizer_writer(args.tokenizer_from)
    gguf.GGUFWriter = writer  # make_tiny_gguf imports it from gguf when called
    make_tiny_gguf(args.out, "llama", Q4_K_M, vocab_size=writer.vocab_size, **{**LLAMA_3_2_1B, "num_layers": args.layers})
    print(args.out)


if __name__ == "__main__":
    main()
