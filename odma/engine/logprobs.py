"""Log-probabilities for the API's `logprobs` / `top_logprobs` / `echo`: of each generated token (from the logits
the sampler draws from) and of each prompt token (for scoring, `max_tokens: 0, echo: true, logprobs: 1`).

They are the model's raw distribution, before temperature, top-p/top-k and min_tokens masking (vLLM's default
`raw_logprobs`): a score of the text, not of the sampler's choice. Prompt scores need the hidden state of every
prompt position, which the model's forward does not return (it projects only each request's last one to the
vocabulary); they are read with a forward hook on the last decoder layer, only in steps where a request asks.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from odma.engine.sequence import TokenLogprob, Work

ROWS_PER_CHUNK = 256  # prompt rows projected to the vocabulary at once (256 × 49k floats = 50 MB)


def _entries(logprobs: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """One entry per row of `logprobs` [rows, vocab] for the token of that row."""
    chosen = logprobs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()
    if k:
        values, ids = logprobs.topk(k, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens, chosen, tops)]


class SampledLogprobs:
    """Log-probabilities of the step's rows whose request asks for them, taken before the sampler masks the
    logits in place; `record` appends one entry per sampled token."""

    def __init__(self, work: list[Work], logits: torch.Tensor) -> None:
        self.rows = [i for i, w in enumerate(work) if w.seq.params.logprobs is not None]
        self.work = work
        self.logprobs = torch.log_softmax(logits[self.rows].float(), dim=-1) if self.rows else None

    def record(self, tokens: list[int | None]) -> None:
        for j, i in enumerate(self.rows):
            if tokens[i] is None:  # a chunk of a longer prefill: nothing sampled
                continue
            seq = self.work[i].seq
            if seq.output_logprobs is None:
                seq.output_logprobs = []
            seq.output_logprobs += _entries(self.logprobs[j : j + 1], [tokens[i]], seq.params.logprobs)


def _prompt_rows(work: list[Work]) -> list[tuple[int, int, int]]:
    """(item, first packed row, absolute position of that row) of the prompt rows still unscored: row p
    predicts prompt token p + 1."""
    out, row = [], 0
    for i, w in enumerate(work):
        seq = w.seq
        if seq.params.prompt_logprobs is not None:
            scored = len(seq.prompt_logprobs or [None])  # entries so far (token 0 has none)
            # rows at positions scored-1 .. len(prompt)-2 predict the unscored prompt tokens
            first = max(w.start, scored - 1)
            last = min(w.start + w.q_len, len(seq.prompt_ids) - 1)
            if first < last:
                out.append((i, row + first - w.start, first))
        row += w.q_len
    return out


@contextmanager
def prompt_logprobs(model: torch.nn.Module, work: list[Work]) -> Iterator[None]:
    """Around one forward: score the prompt tokens this step feeds for requests that ask (nothing is hooked
    when none does). A request fed in chunks, or recomputed after preemption, is scored once per token."""
    wanted = _prompt_rows(work)
    if not wanted:
        yield
        return
    captured: list[torch.Tensor] = []
    handle = model.model.layers[-1].register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        yield
    finally:
        handle.remove()
    hidden = captured[-1]
    with torch.inference_mode():
        _score_prompts(model, work, hidden, wanted)


def _score_prompts(model: torch.nn.Module, work: list[Work], hidden: torch.Tensor,
                   wanted: list[tuple[int, int, int]]) -> None:
    for i, row, pos in wanted:
        seq = work[i].seq
        end = min(work[i].start + work[i].q_len, len(seq.prompt_ids) - 1)
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        for a in range(pos, end, ROWS_PER_CHUNK):
            b = min(end, a + ROWS_PER_CHUNK)
            rows = hidden[row + a - pos : row + b - pos]
            logits = model.lm_head(model.model.norm(rows)).float()
            seq.prompt_logprobs += _entries(torch.log_softmax(logits, dim=-1).cpu(), seq.prompt_ids[a + 1 : b + 1],
                                            seq.params.prompt_logprobs)
