"""Per-request state: token ids, sampling parameters, the predictor's tag, the KV block, timings; its log-probability
records (`TokenLogprob`) and what it is fed in a step (`Work`). The scheduler, the orderings, prefix sharing and the
log-probabilities all read these types, so they live here, in a module that imports none of those, nor torch (the
scheduler's bookkeeping imports it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

from odma.kv import Block, KVHandle
from predictor.base import PredictRequest

if TYPE_CHECKING:
    import torch

    from odma.engine.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestTags:
    """What a client's request says about itself that the length predictor can use (`predictor.features`)."""

    depth: int | None = None  # earlier assistant turns in the conversation (0: a first turn)
    system_prompt_id: str | None = None  # a stable hash of the system prompt: recurring ones are learnable
    prior_output_tokens: float | None = None  # mean tokens of the conversation's earlier assistant replies
    last_output_tokens: int | None = None  # tokens of the latest of them
    # (L̂, u) predicted upstream (a cluster's ingress predicts once, to route by it): the engine tags the request
    # with it instead of running its own predictor
    prediction: tuple[float, float] | None = None


class TokenLogprob(NamedTuple):
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the k most likely tokens, most likely first (k = what was asked)


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    """One request. It is also the pool's `SizedRequest`: `prompt_tokens` / `max_new_tokens` describe the
    tokens its current block was reserved for (after a preemption the recomputed outputs count as prompt)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None
    tags: RequestTags | None = None  # metadata the length predictor reads besides the text
    predicted_length: float | None = None  # L̂ from the predictor
    predicted_tokens: float | None = None  # the pool's view of L̂ (minus recomputed outputs)
    predicted_remaining: float | None = None  # a refined estimate of the output still to come (decode-time)
    growth_hint: float | None = None  # output tokens (of this block's reservation) the next growth should hold
    probe_features: Any = None  # the served model's prompt-end state the length probe read (fp16), for learning
    uncertainty: float = 0.0  # u
    bucket: int | None = None  # the bucket tag the predictor's L̂ selects (scheduling hint)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    kv: KVHandle | None = None  # its KV memory while it holds some (kept current by the pool when it moves)
    num_cached: int = 0  # tokens whose K/V are in the block
    prompt_tokens: int = 0  # pool view, see the class docstring
    max_new_tokens: int = 0
    preemptions: int = 0
    swapped: bool = False  # its cached K/V wait in the host buffer (preempted by swap)
    migrations: int = 0
    device: str = ""  # where the engine placed it (one of --devices)
    waited_steps: int = 0  # scheduling rounds skipped while waiting (starvation guard)
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    # a seeded request's random stream, made when it first samples (`odma.engine.model_runner.seeded_generator`)
    generator: torch.Generator | None = None
    # n > 1: this request is sample `index` of `samples` (one list shared by all of them); samples after the first
    # wait until the first has prefilled the prompt, then copy its K/V (`fork.py`) unless `prompt_copied` failed
    index: int = 0
    samples: list["Sequence"] | None = None
    prompt_copied: bool = False
    output_logprobs: list[TokenLogprob] | None = None  # one per generated token when params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (None for the first)

    def __post_init__(self) -> None:
        self.prompt_tokens = len(self.prompt_ids)
        self.max_new_tokens = self.params.max_tokens

    @property
    def block(self) -> Block | None:
        """The contiguous block its K/V lives in now (None while it holds no memory)."""
        return None if self.kv is None else self.kv.block

    def predictor_fields(self, generator: str | None) -> dict:
        """What the length predictor reads about this request, under `TraceRecord`'s names: the engine predicts
        from it and the length log records it, so a predictor retrained on the log sees what serving gave it."""
        tags = self.tags or RequestTags()
        return {"prompt": self.prompt_text, "prompt_tokens": len(self.prompt_ids),
                "temperature": float(self.params.temperature), "generator": generator,
                "depth": tags.depth, "system_prompt_id": tags.system_prompt_id,
                "prior_output_tokens": tags.prior_output_tokens, "last_output_tokens": tags.last_output_tokens}

    def predict_request(self, generator: str | None) -> PredictRequest:
        """`predictor_fields` as the predictor's own request type."""
        return PredictRequest(**self.predictor_fields(generator))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:  # decoding: only generated tokens (never copy the whole sequence per step)
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def reset_for_recompute(self, kept: int = 0) -> None:
        """After preemption: the block is gone, so every token so far counts as prompt for the next block;
        `kept` tokens of K/V were swapped to the host and come back instead of being recomputed."""
        self.kv = None
        self.growth_hint = None  # it counted the old block's output
        self.num_cached = kept
        self.swapped = kept > 0
        self.prompt_tokens = self.num_tokens
        self.max_new_tokens = self.params.max_tokens - self.num_generated
        if self.predicted_length is not None:
            self.predicted_tokens = max(1.0, self.predicted_length - self.num_generated)
        self.status = Status.WAITING
        self.preemptions += 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(frozen=True, slots=True)
class Work:
    seq: Sequence
    start: int  # tokens already cached
    q_len: int  # tokens fed this step
    copy_from: Sequence | None = None  # the first `start` tokens' K/V are copied from this request's block first
