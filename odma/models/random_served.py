"""`--model random:NAME`: a model of a known shape with random weights, made on the device itself (no checkpoint, no
download: the 7B shape on a GPU in seconds), served with SmolLM2's tokenizer. For benchmarks with forced lengths
(ignore_eos, max_tokens): its tokens mean nothing, its speed and memory are the shape's.

The vocabulary covers the tokenizer's (the tiny shape's is raised to it), so text prompts and SmolLM2 token ids
are valid prompts. The LM head's rows of ids the tokenizer has no text for (past its vocabulary, its special
tokens) are zero: greedy decoding over random logits then picks only tokens that render as text, so a stream's
first chunk comes with its first token (TTFT), and EOS is never chosen (every request runs to max_tokens). The
GEMMs keep the shape's full size."""

from __future__ import annotations

import torch

from odma.errors import ConfigError
from odma.models.llama import CausalLM
from odma.models.tiny import PAPER_7B, TINY_QWEN2, random_model

RANDOM_PREFIX = "random:"
# the shapes odma-serve can make: the paper's model (DeepSeek-R1-Distill-Qwen-7B) and its few-layer CPU stand-in
RANDOM_SHAPES = {"paper-7b": PAPER_7B, "tiny-qwen2": TINY_QWEN2}
RANDOM_TOKENIZER = "smollm2"


def is_random_model(spec: str | None) -> bool:
    """Whether a --model spec names a random model (`random:NAME`)."""
    return bool(spec) and spec.startswith(RANDOM_PREFIX)


def random_shape(spec: str) -> dict:
    """The ModelConfig fields of `random:NAME`; ConfigError naming the known shapes otherwise."""
    name = spec.removeprefix(RANDOM_PREFIX)
    if not is_random_model(spec) or name not in RANDOM_SHAPES:
        known = ", ".join(RANDOM_PREFIX + n for n in RANDOM_SHAPES)
        raise ConfigError(f"model {spec!r}: a random model is one of {known}")
    return RANDOM_SHAPES[name]


def make_random_served_model(spec: str, dtype: torch.dtype, device: str, seed: int = 0) -> tuple[CausalLM, object]:
    """(model, HF tokenizer) for `random:NAME`: the shape's layers with random weights made on `device`, its
    vocabulary at least the tokenizer's, the LM head's rows of ids without text zero (see the module's doc)."""
    from odma.tokenizer import load_tokenizer

    shape = random_shape(spec)
    tokenizer = load_tokenizer(RANDOM_TOKENIZER).hf
    text_ids = len(tokenizer)
    model = random_model(dict(shape, vocab_size=max(shape["vocab_size"], text_ids)), dtype, device, seed=seed)
    with torch.no_grad():
        model.lm_head.weight[text_ids:].zero_()
        model.lm_head.weight[list(tokenizer.all_special_ids)] = 0  # an index_put: indexing by a list copies
    return model, tokenizer
