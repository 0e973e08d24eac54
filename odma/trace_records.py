"""Request traces as data: one record type, a trace, and deterministic splits by prompt. No file is read here
(`odma.trace_sources` reads them; `odma.traces` is the door)."""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import asdict, dataclass, field, fields
from typing import Iterator, NamedTuple

from odma.errors import TraceError


@dataclass(slots=True)
class TraceRecord:
    """One request: what the predictor sees (prompt, metadata) and what happened (realized length)."""

    request_id: str
    prompt: str | None
    prompt_tokens: int
    output_tokens: int | None  # None only in prompt-only sets (no realized length known)
    arrival_s: float = 0.0
    output: str | None = None
    type: str | None = None
    temperature: float | None = None
    system_prompt_id: str | None = None
    depth: int | None = None  # assistant turns before this request in its conversation
    prior_output_tokens: float | None = None  # mean length of those earlier replies (None on a first turn)
    last_output_tokens: int | None = None  # length of the latest of them
    conversation_id: str | None = None  # turns of one conversation share it, and with it their split
    generator: str | None = None
    finished: bool = True  # False: the output hit a length cap, so the length is a lower bound
    source: str = ""

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


RECORD_FIELDS = {f.name for f in fields(TraceRecord)}


@dataclass
class Trace:
    name: str
    records: list[TraceRecord]
    tokenizer: str | None  # which tokenizer counted the tokens ("source": the trace's own counts)
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[TraceRecord]:
        return iter(self.records)

    def output_lengths(self) -> list[int]:
        self.require_lengths()
        return [r.output_tokens for r in self.records]  # type: ignore[misc]

    def require_lengths(self) -> "Trace":
        missing = sum(r.output_tokens is None for r in self.records)
        if missing:
            raise TraceError(
                f"trace {self.name!r} has no realized output length for {missing} of {len(self)} requests "
                "(a prompt-only set); use a trace with output lengths"
            )
        return self

    def subset(self, records: list[TraceRecord], suffix: str) -> "Trace":
        return Trace(f"{self.name}:{suffix}", records, self.tokenizer, dict(self.meta))


class Splits(NamedTuple):
    train: Trace
    val: Trace
    test: Trace


def chat_histories(records) -> list[tuple[tuple[str, str], ...]]:
    """Each record's earlier turns in its conversation as a chat client sends them: (user message, reply) pairs
    of the records before it that share its `conversation_id`, since the latest turn of depth 0 (where a stored
    part, and the trace's history count, starts again). A first turn, a record of no conversation or one without
    text: none."""
    turns: dict[str, list[tuple[str, str]]] = {}
    out: list[tuple[tuple[str, str], ...]] = []
    for r in records:
        if r.conversation_id is None or not r.prompt:
            out.append(())
            continue
        if not r.depth:
            turns[r.conversation_id] = []
        earlier = turns.setdefault(r.conversation_id, [])
        out.append(tuple(earlier))
        if r.output is not None:
            earlier.append((r.prompt, r.output))
    return out


def burst_prompt_ids(records, tokenizer, *, max_prompt: int, vocab_size: int, seed: int = 0) -> list[tuple[int, ...]]:
    """The token ids a burst sends for each record: with a tokenizer, a record's text as the served model sees it
    (`tokenizer.chat_prompt`, after its conversation's earlier turns: `chat_histories`); otherwise random ids of its
    recorded prompt length (seeded: every system and policy gets the same). Cut to `max_prompt`, at least one id,
    folded into `vocab_size`. The GPU bench's burst and its replay both build their prompts here."""
    rng = random.Random(seed)
    out: list[tuple[int, ...]] = []
    for r, history in zip(records, chat_histories(records)):
        if tokenizer is not None and r.prompt:
            ids = tokenizer.encode(tokenizer.chat_prompt(r.prompt, history))[:max_prompt]
        else:
            ids = [rng.randrange(vocab_size) for _ in range(max(1, min(r.prompt_tokens, max_prompt)))]
        out.append(tuple(i % vocab_size for i in ids))
    return out


def forced_lengths(records, max_tokens: int) -> list[int]:
    """Each record's recorded output length cut to `max_tokens`, at least one token: what a burst forces."""
    return [max(1, min(r.output_tokens or 1, max_tokens)) for r in records]


def normalized_prompt(text: str) -> str:
    """Whitespace- and case-insensitive form of a prompt: what counts as 'the same prompt'."""
    return " ".join(text.split()).lower()


def _split_key(record: TraceRecord) -> str:
    # Same prompt text → same split, whatever its id; text-free traces fall back to the id. A conversation's
    # turns stay together: a later turn in test must not have its history's answers in train.
    if record.conversation_id is not None:
        return "conversation:" + record.conversation_id
    if record.prompt is not None:
        return normalized_prompt(record.prompt)
    return record.request_id


def split_trace(trace: Trace, fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)) -> Splits:
    """Deterministic train/validation/test split by a hash of the prompt: no prompt is in two splits."""
    if len(fractions) != 3 or any(f < 0 for f in fractions) or not math.isclose(sum(fractions), 1.0):
        raise TraceError(f"split fractions must be three non-negative numbers summing to 1, got {fractions}")
    cut_train = fractions[0]
    cut_val = fractions[0] + fractions[1]
    parts: tuple[list, list, list] = ([], [], [])
    for record in trace.records:
        digest = hashlib.sha256(_split_key(record).encode()).digest()
        h = int.from_bytes(digest[:8], "big") / 2**64
        parts[0 if h < cut_train else 1 if h < cut_val else 2].append(record)
    return Splits(*(trace.subset(p, name) for p, name in zip(parts, ("train", "val", "test"))))
