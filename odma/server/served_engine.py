"""What odma-serve's HTTP app needs of whatever serves behind it: the whole door between the server and the
engine. `ServedRuntime` is the runtime the app is handed (admission, jobs and their events, lifecycle, the
snapshot /metrics reads); its `engine` is a `ServedEngine` (the model's limits, request checks, decoding). Both
are implemented in process (`runtime.AsyncEngine` over an `LLMEngine`) and at the Ray ingress
(odma.serve_ray.front's `RemoteRuntime` over a `FrontEngine` that holds no model). Nothing in odma/server reaches
past these members (tests/test_server_door.py checks it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol, runtime_checkable

from odma.engine.config import EngineConfig
from odma.engine.sampling import SamplingParams
from odma.engine.sequence import RequestTags, Sequence
from odma.engine.stats import EngineStats

if TYPE_CHECKING:
    from odma.server.admission import Pass


@runtime_checkable
class ServedEngine(Protocol):
    config: EngineConfig
    tokenizer: Any  # a Hugging Face tokenizer (None: token ids in, token ids out)
    max_model_len: int  # prompt + output tokens one request may reach
    model_folder: Path | None  # where the model's files are (its generation_config.json); None: not known

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_ids(self) -> tuple[int, ...]: ...

    @property
    def max_request_tokens(self) -> int:
        """The largest prompt + max_tokens the KV memory can hold for one request."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError / RequestTooLargeError for a request that cannot be served."""

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class Event:
    """One sample's step: its new token (None: none this step) and whether it finished; `seq` has the sample's
    state (tokens, logprobs, finish reason)."""

    token: int | None
    finished: bool
    seq: Sequence


class RequestHandle(Protocol):
    """One HTTP request's samples (n) and the queue their events arrive on."""

    request_ids: list[str]
    remaining: int  # samples not finished yet

    @property
    def finished(self) -> bool: ...


@runtime_checkable
class ServedRuntime(Protocol):
    engine: ServedEngine

    # -- lifecycle
    def start(self) -> None:
        """Begin serving (called once the app's event loop runs)."""

    def stop(self) -> None:
        """Stop serving; requests still live end."""

    def drain(self) -> None:
        """The server is stopping (thread-safe, from a signal handler too): refuse new requests, end live ones."""

    def close(self) -> None:
        """After `stop`: close what the runtime owns (the engine's length log, the probe's state)."""

    @property
    def closing(self) -> bool:
        """Stopping: new requests are refused (503)."""

    @property
    def alive(self) -> bool:
        """The engine runs (its loop thread, or its process): /health answers 503 when not, so that whatever
        supervises the server can restart it."""

    # -- admission
    @property
    def max_queue(self) -> int: ...

    @property
    def waiting(self) -> int:
        """Samples admitted and not running yet (the queue --max-queue bounds)."""

    def admit(self, samples: int = 1) -> Pass | None:
        """Places in the queue for a request of `samples` samples, taken now (None: no room)."""

    # -- requests
    def submit(self, prompt: str | list[int], params: SamplingParams, *, n: int = 1, prompt_text: str | None = None,
               tags: RequestTags | None = None, admitted: Pass | None = None) -> RequestHandle:
        """Queue `n` samples of a prompt; validation errors raise here with nothing queued and the pass released."""

    def events(self, handle: RequestHandle) -> AsyncIterator[Event]:
        """The events of all the handle's samples until each finished; leaving early cancels the rest."""

    def cancel(self, handle: RequestHandle) -> None:
        """Stop the handle's unfinished samples and free their memory."""

    def finish_early(self, request_id: str) -> None:
        """A stop string matched: end the sample as a normal completion."""

    # -- observability
    def stats(self) -> EngineStats:
        """The engine's snapshot (pools, queues, buckets, counters); several replicas' merged behind Ray."""
