"""When a request ends: an end-of-sequence or stop token, a stop string completed by this step's token, or a
length limit (max_tokens, the model's context)."""

from __future__ import annotations

from typing import Any

from odma.engine.sequence import Sequence


def stop_reason(seq: Sequence, tok: int, *, eos_ids: tuple[int, ...], tokenizer: Any, max_model_len: int) -> str | None:
    """"stop", "length", or None (it goes on), after `tok` was appended to the request's output. Stop strings need
    the tokenizer (none: only tokens and lengths end a request)."""
    p = seq.params
    if (tok in eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
        return "stop"
    if p.stop and tokenizer is not None and seq.num_generated >= p.min_tokens and _stop_string_ends(seq, tokenizer):
        return "stop"
    if seq.num_generated >= p.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def _stop_string_ends(seq: Sequence, tokenizer: Any) -> bool:
    """Did this step's token complete a stop string? Only the tail is decoded: a string of n characters spans at
    most n tokens (the HTTP layer trims the text; here the request ends in this very step, so its realized length
    carries no overrun)."""
    window = max(len(s) for s in seq.params.stop) + 2
    ids = seq.output_ids[-window:]
    tail = tokenizer.decode(ids, skip_special_tokens=True)
    if not any(s in tail for s in seq.params.stop):
        return False
    before = tokenizer.decode(ids[:-1], skip_special_tokens=True)  # same start, one token less
    return any(tail.count(s) > before.count(s) for s in seq.params.stop)  # ends in this token (min_tokens)
