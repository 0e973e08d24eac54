"""The work a GPU comparison runs: one burst of requests, each with its prompt (token ids, and its text where the
trace has text), the output length it is forced to, and the KV budget every system gets. The engine's policies,
the HTTP server and a peer all run the same `BurstWork`, so their figures compare."""

from __future__ import annotations

from dataclasses import dataclass


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
