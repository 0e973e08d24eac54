"""The text of a growing list of token ids, kept equal to decoding them all at every step, at a cost per token that
does not grow with the output: only a short window of the last ids is decoded (vLLM's and HF `DecodeStream`'s
prefix / read offsets). Decoding the whole output again for every token cost a 1,000-token stream half a million
tokens' worth of decoding."""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"  # what a decoder writes for the bytes of a character not complete yet
STRIDE = 16  # ids decoded past the settled point before it moves: one decode per token, a second per STRIDE


_PROBE = "a ' b , c . d ' e ! is n't f ' s"  # text a clean-up of spaces rewrites as more of it comes
_rewrites: dict[int, tuple[object, bool]] = {}  # by tokenizer: few per process, kept alive with their answer


def rewrites_text(tokenizer, decode: Callable[[list[int]], str]) -> bool:
    """Whether `decode` (over `tokenizer`'s ids) changes text it already wrote once more ids come: a clean-up of
    spaces (transformers' `clean_up_tokenization_spaces`, WordPiece's decoder) writes "a '" and then "a'b". No window
    can follow that, so such a tokenizer's streams decode the whole output each time. Asked of the tokenizer itself,
    once (which models transformers cleans up for changed between its versions); yes where it cannot say."""
    if tokenizer is None:
        return False
    known = _rewrites.get(id(tokenizer))
    if known is None or known[0] is not tokenizer:
        try:
            ids = tokenizer.encode(_PROBE, add_special_tokens=False)
            texts = [decode(ids[:k]).removesuffix(REPLACEMENT) for k in range(len(ids) + 1)]
            rewrites = any(not b.startswith(a) for a, b in zip(texts, texts[1:]))
        except Exception:  # noqa: BLE001 - a tokenizer that cannot answer is decoded in full
            rewrites = True
        known = _rewrites[id(tokenizer)] = (tokenizer, rewrites)
    return known[1]


class IncrementalText:
    """`push(id)` returns `decode(ids)` of every id pushed so far (the partial character at the end included, as
    `decode` writes it), decoding only the ids since the last settled point and the few before it.

    The text of ids[:read] is settled: it ended on a whole character, and no later id changes it (a decoder that
    maps ids to bytes or pieces and joins them). The window ids[prefix:] is decoded with ids[prefix:read] in front
    (the read point moves once the window passes STRIDE ids past it and ends on a whole character),
    so that a piece's leading space (SentencePiece drops it at the start of a decode) and a WordPiece joint come
    out as in the whole decode; the text past that context is new. Where the window's decode does not begin with
    its context's (a decoder whose output depends on more than the window), this stream decodes in full from then
    on: exact always, fast where the decoder allows. `full_decode=True` decodes in full from the start."""

    def __init__(self, decode: Callable[[list[int]], str], *, full_decode: bool = False) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.full_decode = full_decode
        self.text = ""
        self._settled = ""  # decode(ids[:read])
        self._prefix = 0
        self._read = 0
        self._context = ""  # decode(ids[prefix:read]), decoded on its own as the next window's front is

    def push(self, token: int) -> str:
        """Append `token`; the whole text so far."""
        self.ids.append(token)
        if self.full_decode:
            self.text = self.decode(self.ids)
            return self.text
        window = self.decode(self.ids[self._prefix:])
        if not window.startswith(self._context):
            self.full_decode = True
            self.text = self.decode(self.ids)
            return self.text
        new = window[len(self._context):]
        self.text = self._settled + new
        if len(self.ids) - self._read >= STRIDE and new and not new.endswith(REPLACEMENT):
            self._settled = self.text  # a whole character at the end: settle it
            self._prefix, self._read = self._read, len(self.ids)
            self._context = self.decode(self.ids[self._prefix:self._read])  # not `new`: alone, it may decode apart
        return self.text
