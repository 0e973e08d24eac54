"""Sampling parameters of one request, and the batched sampler (OpenAI's penalties and logit bias, then greedy,
temperature, top-k, top-p)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from odma.errors import InvalidRequestError

# Below this a temperature is greedy (vLLM's _SAMPLING_EPS): logits / 1e-39 overflow float32, and 1e-300 is 0
# there, so a "tiny" temperature sampled garbage instead of the argmax it means.
GREEDY_EPSILON = 1e-5
MAX_TEMPERATURE = 2.0  # OpenAI's and vLLM's bound
MAX_LOGPROBS = 20  # alternatives per token (vLLM's default max_logprobs; OpenAI's top_logprobs bound)
MAX_PENALTY = 2.0  # frequency_penalty and presence_penalty lie in [-2, 2] (OpenAI's bound, vLLM's)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-100, 100] (OpenAI's bound)
SEED_RANGE = (-(2**63), 2**63 - 1)  # OpenAI's schema and vLLM's: a signed 64-bit integer
NO_SEED = -1  # vLLM: seed -1 means unseeded


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # below GREEDY_EPSILON: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-request generator: the same seed gives the same tokens; -1 = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # vLLM extension: keep going past EOS (benchmarks replaying lengths)
    min_tokens: int = 0  # vLLM extension: EOS and stop tokens are masked until this many tokens
    stop: tuple[str, ...] = ()  # stop strings: the engine ends the request in the step that completes one
    logprobs: int | None = None  # log-probabilities of each generated token and of this many alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (echo, scoring)
    # OpenAI's: a token's logit minus frequency_penalty × its count in the output so far, minus presence_penalty
    # once it occurs there; plus its logit_bias (token id, bias) pairs. Logprobs report the model's own logits.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg)

        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if (not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool)
                or not 0 <= self.temperature <= MAX_TEMPERATURE):
            raise bad(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if type(self.top_k) is not int or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if type(self.min_tokens) is not int or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(x, str) and x for x in self.stop):
            raise bad(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if self.seed is not None and (type(self.seed) is not int or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise bad(f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        if self.seed == NO_SEED:
            object.__setattr__(self, "seed", None)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (type(k) is not int or not 0 <= k <= MAX_LOGPROBS):
                raise bad(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise bad(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v!r}")
        if not isinstance(self.logit_bias, tuple) or not all(
                isinstance(pair, tuple) and len(pair) == 2 and type(pair[0]) is int and pair[0] >= 0
                and _number(pair[1]) and -MAX_LOGIT_BIAS <= pair[1] <= MAX_LOGIT_BIAS for pair in self.logit_bias):
            raise bad(f"logit_bias must be (token id >= 0, bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]) pairs, "
                      f"got {self.logit_bias!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties or a logit bias change the logits before a token is picked."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def generator_seed(seed: int, index: int = 0) -> int:
    """The torch generator seed of sample `index` of a request seeded `seed` (vLLM: seed + index), folded into
    [0, 2**64) as torch reads it, so every accepted seed and index is a valid generator seed."""
    return (seed + index) % 2**64


class Sampler:
    """Picks one token per row. Rows that sample use an inverse-CDF draw with one uniform per row,
    taken from the request's own generator when it has a seed (so reruns repeat exactly).
    The logits it is given may be overwritten (a [batch, vocab] copy per step is what it avoids)."""

    @torch.inference_mode()  # logits from the model are inference tensors; they are edited in place below
    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned: list[tuple[int, ...]],
        outputs: list[list[int]] | None = None,
    ) -> list[int]:
        """`outputs`: each row's tokens generated so far (what the penalties count; needed where a row's params
        set one)."""
        logits = logits.float()
        for i, p in enumerate(params):
            if p.adjusts_logits:
                _adjust(logits[i], p, outputs[i] if outputs is not None else ())
        for i, ban in enumerate(banned):
            if ban:  # min_tokens: EOS / stop ids may not end the request yet
                logits[i, list(ban)] = -math.inf
        rows = [i for i, p in enumerate(params) if not p.greedy]
        greedy = [i for i, p in enumerate(params) if p.greedy]
        out = torch.empty(len(params), dtype=torch.long)
        if greedy:  # before _sample, which may scale the logits in place
            out[greedy] = _rows(logits, greedy).argmax(-1)
        if rows:
            out[rows] = self._sample(_rows(logits, rows), [params[i] for i in rows], [generators[i] for i in rows])
        return out.tolist()

    # Top-p/top-k only look at the head of the distribution: take the largest probabilities of each row
    # with a partial top-k (far cheaper than sorting a 50k vocabulary per row), a small head first, and
    # widen it (then sort fully) only for the rows whose head holds less than top_p of the mass. Rows
    # without top-p/top-k draw from the unsorted distribution. The kept set, hence the token for a given
    # uniform draw, is the same as with a full sort. (At batch 48 a top-1024 cost ~24 ms, a top-64 ~5 ms.)
    HEADS = (64, 1024)

    @classmethod
    def _sample(cls, logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]) -> torch.Tensor:
        vocab = logits.shape[-1]
        temp = torch.tensor([p.temperature for p in params]).unsqueeze(1)
        probs = torch.softmax(logits.div_(temp), dim=-1)
        u = torch.cat([torch.rand(1, generator=g) for g in gens])
        out = torch.empty(len(params), dtype=torch.long)
        plain = [i for i, p in enumerate(params) if p.top_p >= 1 and (p.top_k == 0 or p.top_k >= vocab)]
        if plain:
            out[plain] = _inverse_cdf(_rows(probs, plain), u[plain])
        plain_rows = set(plain)
        rows = [i for i in range(len(params)) if i not in plain_rows]  # rows still to sample
        for k in (*(h for h in cls.HEADS if h < vocab), vocab):
            if not rows:
                break
            top_p = torch.tensor([params[i].top_p for i in rows]).unsqueeze(1)
            top_k = torch.tensor([min(params[i].top_k, vocab) if params[i].top_k > 0 else vocab for i in rows]).unsqueeze(1)
            if k < vocab:
                sorted_p, order = _rows(probs, rows).topk(k, dim=-1, sorted=True)
                done = ((sorted_p.sum(-1, keepdim=True) >= top_p) | (top_k <= k)).squeeze(1).tolist()
            else:
                sorted_p, order = _rows(probs, rows).sort(dim=-1, descending=True)
                done = [True] * len(rows)
            here = [j for j, ok in enumerate(done) if ok]
            if here:
                sorted_p, order, top_p, top_k = sorted_p[here], order[here], top_p[here], top_k[here]
                cum = sorted_p.cumsum(-1)
                keep = (cum - sorted_p) < top_p  # the smallest prefix whose mass reaches top_p
                keep[:, 0] = True  # at least the most likely token (a top_p below float32's resolution keeps none)
                keep &= torch.arange(sorted_p.shape[-1]).unsqueeze(0) < top_k
                idx = _inverse_cdf(sorted_p * keep, u[[rows[j] for j in here]])
                out[[rows[j] for j in here]] = order.gather(1, idx.unsqueeze(1)).squeeze(1)
            rows = [rows[j] for j, ok in enumerate(done) if not ok]
        return out


def _adjust(row: torch.Tensor, p: SamplingParams, output: list[int]) -> None:
    """OpenAI's penalties on the tokens of `output`, then the logit bias, on one row of logits in place."""
    if output and (p.frequency_penalty or p.presence_penalty):
        ids, counts = torch.tensor(output, dtype=torch.long).unique(return_counts=True)
        row.index_add_(0, ids, -(counts.float() * p.frequency_penalty + p.presence_penalty))
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long)
        row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype))


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] without copying [batch, vocab] when rows are all of them, in order (the usual case)."""
    return t if len(rows) == t.shape[0] and rows == list(range(len(rows))) else t[rows]


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row, drawn in proportion to the (unnormalized) weights with the uniform u in [0, 1)."""
    cum = weights.cumsum(-1)
    idx = torch.searchsorted(cum, (u * cum[:, -1]).unsqueeze(1)).squeeze(1)
    return idx.clamp_(max=weights.shape[-1] - 1)
