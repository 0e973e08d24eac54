"""What travels between the HTTP side and an engine in another process (odma-serve's engine process, a Ray
replica): the job one HTTP request asks for, and the engine's events for it, one batch per engine step, rebuilt on
the HTTP side into what the answer reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from odma.engine.logprobs import TokenLogprob
from odma.engine.sampling import SamplingParams
from odma.engine.sequence import RequestTags


@dataclass(frozen=True, slots=True)
class RemoteJob:
    """One HTTP request's engine work (its n samples). `need` is what the router weighs: the KV tokens its blocks
    will reserve first (n × (prompt + the policy's reservation for the predicted length))."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1
    prompt_text: str | None = None
    tags: RequestTags | None = None  # tags.prediction: (L̂, u) when the ingress predicted
    need: int = 0
    created_at: float = 0.0  # time.time() at the ingress

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


# One event on the wire: (sample index, token or None, finished, finish_reason, error, tokens generated so far,
# logprob entries since the last event or None, the prompt's logprob entries the first time they exist or None).
WireEvent = tuple


@dataclass(slots=True)
class _Sent:
    logprobs: int = 0
    prompt: bool = False


class EventEncoder:
    """Replica side: engine events → wire events, sending each logprob entry once."""

    def __init__(self) -> None:
        self._sent: dict[int, _Sent] = {}

    def encode(self, token: int | None, finished: bool, seq) -> WireEvent:
        sent = self._sent.setdefault(seq.index, _Sent())
        new_logprobs = None
        if seq.output_logprobs is not None:
            new_logprobs = tuple(seq.output_logprobs[sent.logprobs:])
            sent.logprobs = len(seq.output_logprobs)
        prompt = None
        first = seq.samples[0] if seq.samples else seq
        if not sent.prompt and first.prompt_logprobs is not None:
            prompt, sent.prompt = list(first.prompt_logprobs), True
        return (seq.index, token, finished, seq.finish_reason, seq.error, seq.num_generated, new_logprobs, prompt)


@dataclass(slots=True)
class SampleView:
    """At the ingress, what the answer (odma.server.streams) reads of one engine request: the fields of a
    `Sequence` that its replica sent."""

    request_id: str
    index: int
    finish_reason: str | None = None
    error: str | None = None
    num_generated: int = 0
    output_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    samples: list | None = None  # the prompt's logprobs come with every sample's view
    finished: bool = False

    def apply(self, event: WireEvent) -> tuple[int | None, bool]:
        """Take one wire event; returns (token, finished) for the answer."""
        _, token, finished, reason, error, generated, logprobs, prompt = event
        self.finish_reason, self.error, self.num_generated = reason, error, generated
        if logprobs is not None:
            self.output_logprobs = (self.output_logprobs or []) + [TokenLogprob(*e) for e in logprobs]
        if prompt is not None:
            self.prompt_logprobs = [None if e is None else TokenLogprob(*e) for e in prompt]
        self.finished = finished
        return token, finished

    def fail(self, message: str) -> None:
        self.finish_reason, self.error, self.finished = "error", message, True


def sample_ids(request_id: str, n: int) -> list[str]:
    """The engine's names for the n samples of a request (as `LLMEngine.add_samples` names them)."""
    return [request_id] + [f"{request_id}.{i}" for i in range(1, n)]


@dataclass(slots=True)
class Views:
    request_id: str
    n: int
    views: list[SampleView] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.views = [SampleView(rid, i) for i, rid in enumerate(sample_ids(self.request_id, self.n))]

    def unfinished(self) -> list[SampleView]:
        return [v for v in self.views if not v.finished]
