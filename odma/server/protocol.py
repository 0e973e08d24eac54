"""The OpenAI request bodies we accept (plus vLLM's `ignore_eos` / `min_tokens` / `top_k`) and the mapping
to `SamplingParams`. Response bodies are plain dicts built in `app.py`."""

from __future__ import annotations

import hashlib
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from odma.engine.sampling import SamplingParams
from odma.engine.sequence import RequestTags
from odma.errors import InvalidRequestError


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown OpenAI fields (user, logit_bias...) are ignored

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    # vLLM extensions: benchmarks replay realized lengths with them
    ignore_eos: bool = False
    min_tokens: int = 0
    top_k: int = 0

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise InvalidRequestError("stop strings must be non-empty")
        if len(stops) > 4:
            raise InvalidRequestError("at most 4 stop strings")
        return stops

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def sampling(self, max_tokens: int | None, default_max: int) -> SamplingParams:
        if self.n != 1:
            raise InvalidRequestError(f"n must be 1 (got {self.n}): send several requests instead")
        if max_tokens is None:
            max_tokens = default_max
        if type(max_tokens) is not int:
            raise InvalidRequestError(f"max_tokens must be an integer, got {max_tokens!r}")
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=self.seed, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, stop=tuple(self.stop_strings()),
        )


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = 16  # OpenAI's default for /v1/completions
    echo: bool = False
    logprobs: int | None = None

    def prompt_input(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list):
            if len(p) == 1 and isinstance(p[0], str):
                p = p[0]
            elif p and all(isinstance(x, str) for x in p):
                raise InvalidRequestError("a list of several prompts is not supported: send one request each")
        if self.echo or self.logprobs:
            raise InvalidRequestError("echo and logprobs are not supported")
        if (isinstance(p, str) and not p) or (isinstance(p, list) and not p):
            raise InvalidRequestError("prompt must not be empty")
        return p


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # the newer OpenAI name for max_tokens

    def chat(self) -> list[dict]:
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]
        if not any(m["content"].strip() for m in msgs):
            raise InvalidRequestError("messages must contain some text")
        return msgs

    def tags(self, count_tokens: Callable[[str], int]) -> RequestTags:
        """The predictor's metadata: how deep the conversation is (assistant turns so far), how long those
        replies were (a conversation's reply lengths go together), and which system prompt it runs under (a
        hash: the same instructions recur across a deployment's requests)."""
        system = "\n".join(m.text() for m in self.messages if m.role in ("system", "developer"))
        sid = "sys-" + hashlib.sha1(system.encode("utf-8")).hexdigest()[:12] if system.strip() else None
        replies = [count_tokens(m.text()) for m in self.messages if m.role == "assistant"]
        return RequestTags(depth=len(replies), system_prompt_id=sid,
                           prior_output_tokens=sum(replies) / len(replies) if replies else None,
                           last_output_tokens=replies[-1] if replies else None)

    def user_text(self) -> str:
        """The last user turn: what the length predictor reads."""
        for m in reversed(self.messages):
            if m.role == "user":
                return m.text()
        return self.messages[-1].text()
