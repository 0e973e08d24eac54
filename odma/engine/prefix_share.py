"""Prompt prefixes shared by copy: a request whose prompt begins like a running request's cached tokens copies
their K/V into its own block and prefills only the rest (the paged baseline maps the holder's whole pages instead:
`PagedKV.admit_sharing`).

Chat traffic repeats itself at the front: the chat template's system prompt (24 tokens of SmolLM2's, on every
request without a system turn), an application's instructions, a conversation's earlier turns. vLLM keeps such
blocks in its paged pool and maps them into new requests; a contiguous block cannot point into another, but a
copy of a few thousand K/V rows is cheap next to recomputing them (a 24-token prefix of SmolLM2: 1.1 MB, tens of
microseconds; its prefill: ~25 ms on one core). The K/V of a prefix do not depend on what follows it (causal
attention, positions from 0), so any holder of the same first tokens will do, whatever its own prompt continues
with.

This module is the bookkeeping only (no tensors): an index of the running requests by their first tokens, and
the longest prefix a waiting request can copy. The scheduler plans the copy (`Work.copy_from`); the engine does
it before the model step (`copy_prefixes`).
"""

from __future__ import annotations

from odma.engine.sequence import Sequence, Work

MAX_CANDIDATES = 8  # holders compared per lookup (most recent first): the first tokens already matched


class PrefixIndex:
    def __init__(self, min_tokens: int = 16) -> None:
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        self.min_tokens = min_tokens  # shorter shares are not worth a copy (nor the index entry)
        self._by_key: dict[tuple[int, ...], list[Sequence]] = {}

    def _key(self, seq: Sequence) -> tuple[int, ...] | None:
        if seq.num_tokens < self.min_tokens:
            return None
        return tuple(seq.token_ids(0, self.min_tokens))

    def add(self, seq: Sequence) -> None:
        """`seq` holds a block now: once its K/V are cached, others may copy from it."""
        key = self._key(seq)
        if key is not None:
            self._by_key.setdefault(key, []).append(seq)

    def remove(self, seq: Sequence) -> None:
        """`seq` lost its block (finished, preempted): nobody copies from it any more."""
        key = self._key(seq)
        holders = self._by_key.get(key) if key is not None else None
        if holders and seq in holders:
            holders.remove(seq)
            if not holders:
                del self._by_key[key]

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_key.values())

    def lookup(self, seq: Sequence) -> tuple[Sequence | None, int]:
        """(holder, tokens): the running request whose cached K/V share the longest prefix with `seq`'s tokens,
        and how many to copy (at least min_tokens, and never the last token: its logits give the next one).
        (None, 0) when none shares min_tokens."""
        key = self._key(seq)
        holders = self._by_key.get(key, []) if key is not None else []
        recent = [h for h in reversed(holders[-MAX_CANDIDATES:]) if h.kv is not None]  # a block, or pages
        return self._longest(seq, recent, lambda other: other.num_cached)

    def shared_with(self, seq: Sequence, others: list[Sequence]) -> int:
        """Tokens `seq` shares at the front with the longest of `others` (requests prefilled in this step, whose
        K/V a later step could copy); 0 below min_tokens."""
        return self._longest(seq, others, lambda other: other.num_tokens)[1]

    def _longest(self, seq: Sequence, others: list[Sequence], held) -> tuple[Sequence | None, int]:
        """The one of `others` whose first `held(other)` tokens share the longest prefix with `seq`'s tokens (but
        its last), and that length; (None, 0) below min_tokens."""
        key = self._key(seq)
        if key is None:
            return None, 0
        limit = seq.num_tokens - 1
        ids = seq.token_ids(0, limit)
        best, best_n = None, 0
        for other in others:
            if other is seq or self._key(other) != key:
                continue
            n = shared_prefix(ids, other.token_ids(0, min(limit, held(other))))
            if n > best_n:
                best, best_n = other, n
        return (best, best_n) if best_n >= self.min_tokens else (None, 0)


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case for a shared system prompt held by a longer request: one C compare
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on slice compares (C speed, log n of them)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def copy_prefixes(work: list, arena) -> list:
    """The step's work with each planned prefix copy done (`Work.copy_from`): the holder's first `start` tokens'
    K/V are copied into the request's block. A holder that no longer has them (it cannot lose them between the
    scheduler's plan and this call, but a wrong copy would be silent) turns the item back into a full prefill."""
    out = []
    for w in work:
        source = w.copy_from
        if source is None:
            out.append(w)
            continue
        seq = w.seq
        if source.block is None or source.num_cached < w.start or seq.block is None:
            out.append(Work(seq, 0, w.start + w.q_len))
            continue
        copy_first_rows(arena, source.kv, seq.block, w.start)
        seq.num_cached = w.start
        out.append(w)
    return out


def copy_first_rows(arena, source, dst, n: int) -> None:
    """The first `n` rows of `source` (a KVHandle: its block, and the pieces it reads from other blocks where it
    reads a shared prefix in place, odma.kv.shared_rows) into block `dst` from its row 0."""
    if not source.pieces:
        arena.copy(source.block, dst, n)
        return
    target = arena.view(dst)
    previous = 0
    for handle, first, end in [*source.pieces, (source, source.first_row, n)]:
        end = min(end, n)
        if end > previous:
            target[:, :, previous:end] = arena.view(handle.block)[:, :, previous - first:end - first]
        previous = end
