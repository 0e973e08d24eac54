"""A generated output's text: its ids less EOS, special tokens skipped. One implementation for every engine that
serves text (LLMEngine, the Ray ingress's FrontEngine)."""

from __future__ import annotations

from typing import Any, Callable


class OutputDecoder:
    """`decoder(ids)` is `tokenizer.decode([t for t in ids if t not in eos_ids], skip_special_tokens=True)` ("" with
    no tokenizer). A stream decodes a few ids per token: where transformers' decode is the Rust tokenizer's and
    nothing more, that is called directly (its Python wrapper cost several times the decode of a short window)."""

    def __init__(self, tokenizer: Any, eos_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self._decode = _direct_decode(tokenizer) or (
            (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer is not None else None)

    def __call__(self, ids: list[int]) -> str:
        if self._decode is None:
            return ""
        eos = self.eos_ids
        return self._decode([t for t in ids if t not in eos])


def _direct_decode(tokenizer: Any) -> Callable[[list[int]], str] | None:
    """The Rust tokenizer's decode when transformers' `decode(ids, skip_special_tokens=True)` of a list of ids is
    exactly that: its own fast tokenizer class, neither decode overridden, no clean-up of spaces applied (transformers
    5 skips it for BPE models unless forced). None otherwise (another version, a subclass, a slow tokenizer)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if not (isinstance(tokenizer, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode):
        return None
    backend = tokenizer.backend_tokenizer
    bpe_exempt = (type(backend.model).__name__ == "BPE"
                  and not getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                                  False))
    if tokenizer.clean_up_tokenization_spaces and not bpe_exempt:
        return None
    return lambda ids: backend.decode(ids, skip_special_tokens=True)
