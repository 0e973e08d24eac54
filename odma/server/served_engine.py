"""What odma-serve's HTTP app reads of an engine: the whole door between the server and whatever serves behind it
(the in-process `LLMEngine`, or the Ray ingress's `FrontEngine` that holds no model). The engine loop
(`runtime.py`) drives an `LLMEngine` itself; the app, the request checks and the answers go through this."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from odma.engine.config import EngineConfig
from odma.engine.sampling import SamplingParams


@runtime_checkable
class ServedEngine(Protocol):
    config: EngineConfig
    tokenizer: Any  # a Hugging Face tokenizer (None: token ids in, token ids out)
    max_model_len: int  # prompt + output tokens one request may reach

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
