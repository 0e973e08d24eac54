"""Response bodies in OpenAI's shapes: choices, usage, and logprobs (the legacy completions form with
`text_offset`, the chat form with `bytes`)."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Collection, Iterable

from odma.engine.logprobs import TokenLogprob

MIN_LOGPROB = -9999.0  # JSON has no -Infinity: a token of probability 0 reports this (as vLLM does)


class TokenText:
    """Each token's text and exact bytes (a byte-level BPE token may be part of a character: its bytes are what
    the chat form's `bytes` field is for)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_decoder = _byte_decoder()
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer is not None else str(token)

    def _bytes(self, token: int) -> list[int]:
        raw = self.tokenizer.convert_ids_to_tokens(token) if self.tokenizer is not None else None
        if isinstance(raw, str) and raw and all(c in self._byte_decoder for c in raw):
            return [self._byte_decoder[c] for c in raw]
        return list(self.text(token).encode("utf-8"))


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character each byte is spelled with → the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return {c: b for b, c in enumerate(chars)}


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _shown(token: int, texts: TokenText, silent: Collection[int]) -> str:
    """A token's text as the answer shows it: EOS adds none to a generated text, so its entry's text is empty."""
    return "" if token in silent else texts.text(token)


def completion_logprobs(entries: Iterable[TokenLogprob | None], tokens: list[int], texts: TokenText,
                        offset: int = 0, silent: Collection[int] = ()) -> tuple[dict[str, Any], int]:
    """The legacy `logprobs` object for `tokens` (an entry of None: the first prompt token, which has no
    log-probability), and the text offset after them. `silent`: tokens shown with empty text (EOS in an answer)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries):
        text = _shown(token, texts, silent)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_lp(entry.logprob))
        top = {_shown(t, texts, silent): _lp(lp) for t, lp in entry.top}
        top.setdefault(text, _lp(entry.logprob))  # the chosen token is always listed (up to k + 1 entries)
        out["top_logprobs"].append(top)
    return out, offset


def chat_logprobs(entries: Iterable[TokenLogprob], texts: TokenText, silent: Collection[int] = ()) -> list[dict[str, Any]]:
    """The chat form's `logprobs.content` items (`silent` tokens, EOS, with empty text and no bytes)."""

    def item(token: int, logprob: float) -> dict[str, Any]:
        text = _shown(token, texts, silent)
        return {"token": text, "logprob": _lp(logprob), "bytes": texts.bytes(token) if text else []}

    return [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(rid: str, chat: bool, created: int, model: str, choices: list, *, chunk: bool = False) -> dict[str, Any]:
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}


class TextChunk:
    """The stream's commonest event, a choice's text alone (no logprobs, no finish reason), rendered from the
    chunk's constant parts (id, object, created, model; a null usage when the stream reports usage at its end)
    encoded once: byte for byte the `json.dumps` of the whole chunk, without building and encoding it per token."""

    def __init__(self, rid: str, chat: bool, created: int, model: str, *, null_usage: bool = False) -> None:
        head = json.dumps(envelope(rid, chat, created, model, [], chunk=True))  # ends with "choices": []}
        self._head = "data: " + head[: -len("[]}")] + '[{"index": '
        self._text = ', "delta": {"content": ' if chat else ', "text": '
        close = "}" if chat else ""
        self._tail = close + ', "finish_reason": null, "logprobs": null}]' + (', "usage": null' if null_usage else "")
        self._tail += "}\n\n"

    def __call__(self, index: int, text: str) -> str:
        return f"{self._head}{index}{self._text}{json.dumps(text)}{self._tail}"
