"""From a validated request body to what the engine runs (`Job`): the prompt's token ids, the sampling
parameters with the server's defaults filled in, and what the answer carries (echo, logprobs). Checks that
need the tokenizer or cross two fields (JSON Schema cannot say them) raise InvalidRequestError here."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from odma.engine.sampling import SamplingParams
from odma.engine.sequence import RequestTags
from odma.errors import InvalidRequestError, RequestTooLargeError
from odma.server.generation_config import SamplingDefaults
from odma.server.protocol import ApiLimits
from odma.server.served_engine import ServedEngine


@dataclass(frozen=True, slots=True)
class Job:
    """What one HTTP request asks of the engine, and how its answer is shaped."""

    chat: bool
    prompt_ids: list[int]
    prompt_text: str | None  # what the length predictor reads
    tags: RequestTags | None
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    echo: str | None = None  # completions with echo: the prompt text the choices start with
    generate: bool = True  # False: max_tokens 0 (the engine's one token is computed for the logprobs, not sent)
    logprobs: int | None = None  # alternatives per token (completions' logprobs, chat's top_logprobs)
    usage_every_chunk: bool = False  # stream_options.continuous_usage_stats (vLLM): usage so far in every chunk


def max_prompt_chars(tokenizer, context_tokens: int) -> int | None:
    """The most characters a prompt that fits `context_tokens` can have: one token spans at most as many characters
    as the longest vocabulary entry has (a byte-level BPE entry spells each of its bytes with one character, and a
    character is at least a byte). None without a tokenizer."""
    if tokenizer is None:
        return None
    return context_tokens * max(len(entry) for entry in tokenizer.get_vocab())


class JobBuilder:
    def __init__(self, engine: ServedEngine, limits: ApiLimits, defaults: SamplingDefaults) -> None:
        self.engine, self.limits, self.defaults = engine, limits, defaults

    def completions(self, body) -> list[Job]:
        """One job per prompt of the request, every prompt checked before any runs: one that cannot run refuses
        the whole request, naming it (`prompt[i]`) in a batch of several."""
        prompts = body.prompts()
        jobs = []
        for i, prompt in enumerate(prompts):
            try:
                jobs.append(self.completion(body, prompt))
            except InvalidRequestError as exc:
                if len(prompts) == 1:
                    raise
                raise type(exc)(f"prompt[{i}]: {exc}") from None
        return jobs

    def completion(self, body, prompt: str | list[int]) -> Job:
        if isinstance(prompt, str):
            self._fits(len(prompt), "the prompt")
            ids, text = self._encode(prompt), prompt
        else:
            ids, text = list(prompt), None
        max_tokens = body.max_tokens if body.max_tokens is not None else min(16, self.limits.max_tokens_cap)
        echo = None
        if body.echo:
            echo = text if text is not None else self._decode(ids)
        k = body.logprobs
        params = self._params(body, max_tokens, logprobs=k, prompt_logprobs=k if echo is not None else None)
        self.engine.validate(ids, params)  # here, off the event loop: a long prompt's checks take a while too
        return Job(False, ids, text, None, params, body.n or 1, bool(body.stream), body.include_usage(), echo,
                   max_tokens > 0, k, usage_every_chunk=body.continuous_usage())

    def chat(self, body) -> Job:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; use /v1/completions")
        if body.top_logprobs and not body.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true")
        self._fits(sum(len(m.text()) for m in body.messages), "the messages")
        try:
            text = tok.apply_chat_template(body.chat(), add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - templates raise on bad role orders etc.
            raise InvalidRequestError(f"cannot apply the chat template: {exc}") from None
        self._fits(len(text), "the templated chat")
        ids = self._encode(text)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # the server's default, but no more than the context leaves (as vLLM)
            default = self.defaults.max_tokens or self.limits.default_max_tokens
            max_tokens = max(1, min(default, self._room() - len(ids)))
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = self._params(body, max_tokens, logprobs=k)
        self.engine.validate(ids, params)
        return Job(True, ids, body.user_text(), self._tags(body), params, body.n or 1, bool(body.stream),
                   body.include_usage(), logprobs=k, usage_every_chunk=body.continuous_usage())

    # -- pieces ------------------------------------------------------------------------------------

    def _params(self, body, max_tokens: int, *, logprobs: int | None = None,
                prompt_logprobs: int | None = None) -> SamplingParams:
        d = self.defaults
        min_tokens = body.min_tokens or 0
        if min_tokens > max_tokens:
            raise InvalidRequestError(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})")
        top_k = d.top_k if body.top_k is None else max(body.top_k, 0)
        return SamplingParams(
            max_tokens=max(max_tokens, 1),  # max_tokens 0: one token is computed, none is sent
            temperature=d.temperature if body.temperature is None else body.temperature,
            top_p=d.top_p if body.top_p is None else body.top_p,
            top_k=top_k, seed=body.seed, ignore_eos=bool(body.ignore_eos), min_tokens=min_tokens,
            stop=body.stop_strings(), stop_token_ids=tuple(body.stop_token_ids or ()),
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            frequency_penalty=body.frequency_penalty or 0.0, presence_penalty=body.presence_penalty or 0.0,
            logit_bias=tuple((int(t), float(b)) for t, b in (body.logit_bias or {}).items()),
        )

    def _fits(self, chars: int, what: str) -> None:
        """Refuse text that cannot fit the context before tokenizing it (10 MB took the tokenizer most of a
        minute), by its length in characters."""
        bound = self.limits.max_prompt_chars
        if bound is not None and chars > bound:
            raise RequestTooLargeError(
                f"{what} has {chars:,} characters: no text longer than {bound:,} characters fits this server's "
                f"context of {self.engine.max_model_len:,} tokens")

    def _encode(self, text: str) -> list[int]:
        tok = self.engine.tokenizer
        if tok is None:
            raise InvalidRequestError("this engine has no tokenizer: send token ids")
        fast = getattr(tok, "backend_tokenizer", None)
        if fast is not None:  # the same ids, 3x faster, and the batch call lets go of the interpreter lock meanwhile
            return fast.encode_batch([text], add_special_tokens=False)[0].ids
        return tok.encode(text, add_special_tokens=False)

    def _decode(self, ids: list[int]) -> str:
        tok = self.engine.tokenizer
        return tok.decode(ids, skip_special_tokens=False) if tok is not None else ""

    def _room(self) -> int:
        """Prompt + output tokens one request may hold: the model's context or the largest block, less."""
        return min(self.engine.max_model_len, self.engine.max_request_tokens)

    def _tags(self, body) -> RequestTags:
        """The predictor's metadata: how deep the conversation is (assistant turns so far), how long those
        replies were (a conversation's reply lengths go together), and which system prompt it runs under (a
        hash: the same instructions recur across a deployment's requests)."""
        tok = self.engine.tokenizer
        system = "\n".join(m.text() for m in body.messages if m.role in ("system", "developer"))
        sid = "sys-" + hashlib.sha1(system.encode("utf-8")).hexdigest()[:12] if system.strip() else None
        replies = [len(tok.encode(m.text(), add_special_tokens=False)) for m in body.messages if m.role == "assistant"]
        return RequestTags(depth=len(replies), system_prompt_id=sid,
                           prior_output_tokens=sum(replies) / len(replies) if replies else None,
                           last_output_tokens=replies[-1] if replies else None)
