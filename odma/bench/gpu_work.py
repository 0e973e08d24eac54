"""The work a GPU comparison runs: one burst of requests, each with its prompt (token ids, and its text where the
trace has text), the output length it is forced to, and the KV budget every system gets. The engine's policies,
the HTTP server and a peer all run the same `BurstWork`, so their figures compare."""

from __future__ import annotations

from dataclasses import dataclass

from odma.trace_records import burst_prompt_ids, forced_lengths

# a dry run's caps (`--tiny`: the tiny model, on a CPU in Triton's interpreter, where every step costs ~0.1 s):
# short prompts and outputs, enough for every part's orchestration
TINY_MAX_PROMPT, TINY_MAX_TOKENS = 24, 8


def burst_caps(max_prompt: int, max_tokens: int, tiny: bool) -> tuple[int, int]:
    """(max_prompt, max_tokens) of a run: as asked, or within the dry run's caps."""
    return (min(max_prompt, TINY_MAX_PROMPT), min(max_tokens, TINY_MAX_TOKENS)) if tiny else (max_prompt, max_tokens)


@dataclass(frozen=True)
class BurstWork:
    name: str  # the trace it came from (azure-conv, a JSONL path, ...)
    prompts: tuple[tuple[int, ...], ...]  # token ids of each prompt, as the model sees it (chat template applied)
    texts: tuple[str | None, ...]  # each prompt's text (None: the trace has lengths only, the ids are random)
    lengths: tuple[int, ...]  # each request's output length: the recorded one, cut to max_tokens
    max_tokens: int  # every request's max_tokens (what a system that must reserve the worst case reserves)
    kv_budget: str  # the KV cache every system gets ("4GiB")

    def __post_init__(self) -> None:
        n = len(self.prompts)
        if not (len(self.texts) == len(self.lengths) == n) or n == 0:
            raise ValueError(f"a burst needs as many texts and lengths as prompts (>0), got {n}, "
                             f"{len(self.texts)}, {len(self.lengths)}")
        if any(not p for p in self.prompts) or any(not 1 <= n <= self.max_tokens for n in self.lengths):
            raise ValueError("every prompt needs a token, every length must lie in 1..max_tokens")

    @property
    def requests(self) -> int:
        return len(self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))


def burst_from_records(name: str, records, *, max_prompt: int, max_tokens: int, kv_budget: str, vocab_size: int,
                       tokenizer=None, seed: int = 0) -> BurstWork:
    """The burst of a trace's records, in their order. A record with a prompt becomes that prompt as the served
    model sees it (`tokenizer.chat_prompt`, SmolLM2's chat template), after its conversation's earlier turns in the
    burst (`chat_histories`: a ShareGPT chat turn is sent with its history), tokenized and cut to `max_prompt` tokens;
    its text (the user's message, what a length predictor is trained on) is kept. A trace without text (Azure's
    lengths only) gets random ids of its recorded prompt length, cut likewise (texts None). Every request is
    forced to its recorded output length cut to `max_tokens` (at least 1). Ids at or past `vocab_size` (a tiny
    model's vocabulary) are folded into it, so the same work runs on a dry-run model. Torch-free."""
    records = list(records)
    if not records:
        raise ValueError(f"trace {name!r} has no records")
    with_text = [bool(r.prompt) for r in records]
    if any(with_text) and not all(with_text):
        raise ValueError(f"trace {name!r} mixes records with and without a prompt text: a burst is one or the other")
    if any(with_text) and tokenizer is None:
        raise ValueError(f"trace {name!r} has text: its prompts need a tokenizer")
    prompts = burst_prompt_ids(records, tokenizer, max_prompt=max_prompt, vocab_size=vocab_size, seed=seed)
    texts = tuple(r.prompt or None for r in records)
    return BurstWork(name, tuple(prompts), texts, tuple(forced_lengths(records, max_tokens)), max_tokens, kv_budget)


def burst_from_trace(spec: str, requests: int, *, max_prompt: int, max_tokens: int, kv_budget: str,
                     vocab_size: int, tokenizer_name: str = "smollm2") -> BurstWork:
    """`burst_from_records` over the first `requests` records of `odma.traces.load_trace(spec)` (a named trace or
    a JSONL path); SmolLM2's tokenizer (`odma.tokenizer.load_tokenizer`) is loaded only for a trace with text."""
    from odma.traces import load_trace

    records = load_trace(spec, limit=requests).records[:requests]
    tokenizer = None
    if any(r.prompt for r in records):
        from odma.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_name)
    return burst_from_records(spec, records, max_prompt=max_prompt, max_tokens=max_tokens, kv_budget=kv_budget,
                              vocab_size=vocab_size, tokenizer=tokenizer)
