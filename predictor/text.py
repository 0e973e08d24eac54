"""Prompt text → encoder token ids, the same way at training and at serving time."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Characters kept from each end before tokenizing: a 200K-token paste must not cost a 200K-token
# tokenization at serving time; 12 characters per token is far more than any tokenizer needs.
CHARS_PER_TOKEN_BUDGET = 12


@dataclass(frozen=True, slots=True)
class EncodedBatch:
    input_ids: np.ndarray  # int64 [n, seq]
    attention_mask: np.ndarray  # int64 [n, seq]


def clip_text(text: str | None, max_len: int) -> str:
    """The text the encoder sees: the head and tail of long prompts (the instruction is often at one end)."""
    text = text or ""
    budget = max_len * CHARS_PER_TOKEN_BUDGET
    if len(text) <= budget:
        return text
    tail = budget // 4
    return text[: budget - tail] + " … " + text[-tail:]


def head_tail(ids: list[int], keep: int) -> list[int]:
    """Keep three quarters of the budget from the start and a quarter from the end."""
    if len(ids) <= keep:
        return ids
    tail = keep // 4
    return ids[: keep - tail] + (ids[-tail:] if tail else [])


def encode_texts(hf_tokenizer, texts: list[str | None], max_len: int) -> EncodedBatch:
    """[CLS] head…tail [SEP], padded to the longest row of this batch (not to max_len: short prompts stay cheap)."""
    clipped = [clip_text(t, max_len) for t in texts]
    pieces = hf_tokenizer(clipped, add_special_tokens=False, truncation=False)["input_ids"] if clipped else []
    cls, sep = hf_tokenizer.cls_token_id, hf_tokenizer.sep_token_id
    pad = hf_tokenizer.pad_token_id or 0
    inner = max_len - (cls is not None) - (sep is not None)
    rows = []
    for ids in pieces:
        row = head_tail(list(ids), inner)
        rows.append(([cls] if cls is not None else []) + row + ([sep] if sep is not None else []))
    width = max((len(r) for r in rows), default=1)
    input_ids = np.full((len(rows), width), pad, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return EncodedBatch(input_ids, mask)
