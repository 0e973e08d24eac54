"""The OpenAI request bodies odma-serve accepts (plus vLLM's `ignore_eos`, `min_tokens`, `top_k`,
`stop_token_ids`); the bodies it sends are in `responses.py`.

Requests are validated strictly, as OpenAI's schema is: `max_tokens: "5"`, `5.0` or `true` are refused, not
coerced; an unknown parameter is refused, not ignored; a parameter odma cannot honour (best_of > 1, suffix,
tools, a JSON response format) is declared with the only value it accepts, so a client that asks
for it gets a 400 saying so. The models are built per server (`request_models`) from its limits, so the
published schema (/openapi.json) states exactly what the server enforces: the token cap, n, the vocabulary,
the served model names. What JSON Schema cannot say (prompt + max_tokens must fit the context, min_tokens <=
max_tokens, top_logprobs needs logprobs) is checked by the handlers and stated in the field descriptions.
"""

# no `from __future__ import annotations`: the models built in `request_models` annotate with expressions over
# its local limits, which pydantic must see evaluated

from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, WrapValidator,
                      field_validator)
from pydantic_core import PydanticCustomError

from odma.engine.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY, MAX_TEMPERATURE, SEED_RANGE

MAX_STOPS = 4
MAX_TOP_K = 2**31 - 1
# "top_logprobs > 0 needs logprobs: true", as JSON Schema can say it (the handler checks it too)
TOP_LOGPROBS_NEED_LOGPROBS = {"anyOf": [
    {"properties": {"top_logprobs": {"anyOf": [{"type": "integer", "maximum": 0}, {"type": "null"}]}}},
    {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
]}
# "stream_options needs stream: true" (OpenAI and vLLM refuse it otherwise; null is leaving it out)
STREAM_OPTIONS_NEED_STREAM = {"anyOf": [
    {"not": {"required": ["stream_options"]}},
    {"properties": {"stream_options": {"nullable": True, "enum": [None]}}},
    {"properties": {"stream": {"const": True}}, "required": ["stream"]},
]}


@dataclass(frozen=True, slots=True)
class ApiLimits:
    """What a server enforces on every request; its schema publishes the same numbers."""

    served_names: tuple[str, ...]
    vocab_size: int
    max_tokens_cap: int
    max_n: int = 16
    max_prompts: int = 128  # prompts in one completions request (a batch, as lm-eval's batch_size sends)
    default_max_tokens: int = 256  # chat requests that set no max_tokens (at most what the context leaves)
    # the longest prompt text that could fit the context (`jobs.max_prompt_chars`): longer is refused untokenized
    max_prompt_chars: int | None = None


# -- field types --------------------------------------------------------------------------------------

def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON may carry "\ud800": a lone UTF-16 surrogate is no character
        raise PydanticCustomError("unicode", "contains a lone UTF-16 surrogate at character {at}; send valid Unicode",
                                  {"at": exc.start}) from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[Text, Field(min_length=1)]


def _one_message(message: str) -> WrapValidator:
    """A union's failure as one message (pydantic reports every branch), unless the value was text with a
    lone surrogate: that message is the precise one."""

    def wrap(value: Any, handler):
        try:
            return handler(value)
        except ValidationError as exc:
            for e in exc.errors():
                if e["type"] == "unicode":
                    raise PydanticCustomError("unicode", e["msg"]) from None
            raise PydanticCustomError("invalid", message) from None

    return WrapValidator(wrap)


def _only(value: Any, why: str, schema: dict) -> tuple:
    """Metadata for a parameter that is accepted only with its default value: the schema says so and any other
    value is refused with `why`."""

    def check(v: Any) -> Any:
        if v not in (None, value) and not (isinstance(value, (dict, list, str)) and not v):
            raise PydanticCustomError("unsupported", why)
        return v

    return AfterValidator(check), Field(json_schema_extra=schema, description=why)


def _opt(t: Any, *meta: Any) -> Any:
    """`t | None`, with `meta` (validators, constraints) on `t`."""
    return Annotated[(t, *meta)] | None if meta else t | None


def _decimal_up_to(n: int) -> str:
    """A pattern matching exactly the decimal numbers 0..n, without leading zeros (logit_bias's keys are token ids
    as strings: the schema bounds them by the vocabulary as it bounds token ids)."""
    s = str(n)
    parts = (["[0-9]"] + [f"[1-9][0-9]{{{k - 1}}}" for k in range(2, len(s))]) if len(s) > 1 else []
    for i, d in enumerate(s):  # as long as n, below it: n's first i digits, a smaller one, then any
        low = 1 if i == 0 and len(s) > 1 else 0
        if int(d) > low:
            rest = len(s) - i - 1
            parts.append(s[:i] + f"[{low}-{int(d) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    return "^(" + "|".join([*parts, s]) + ")$"


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool | None = None
    # vLLM's extension (guidellm sends it): with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool | None = Field(None, description="with include_usage: usage in every chunk (vLLM)")


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: Text


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"] = Field(description="only plain text: JSON modes are not supported")


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: Text | None = None
    tool_call_id: Text | None = None

    def text(self) -> str:
        content = self.content  # each kind of message declares its own
        if content is None or isinstance(content, str):
            return content or ""
        return "".join(part.text for part in content)


class ChatMessage(_Message):
    """A system, developer or user turn: its content is required, as in OpenAI's API."""

    role: Literal["system", "user", "developer"]
    content: Annotated[Text | list[TextPart], _one_message("must be a string or a list of text parts")]


class ToolMessage(_Message):
    """A tool's answer: its content and the id of the call it answers are required, as in OpenAI's API."""

    role: Literal["tool"]
    content: Annotated[Text | list[TextPart], _one_message("must be a string or a list of text parts")]
    tool_call_id: Text


class AssistantMessage(_Message):
    """An assistant turn: OpenAI lets it go without content (beside tool calls, which odma refuses)."""

    role: Literal["assistant"]
    content: Annotated[Text | list[TextPart] | None,
                       _one_message("must be a string, a list of text parts or null")] = None


Message = Annotated[ChatMessage | ToolMessage | AssistantMessage, Field(discriminator="role")]
ROLES = frozenset(role for kind in (ChatMessage, ToolMessage, AssistantMessage)
                  for role in get_args(kind.model_fields["role"].annotation))


def request_models(limits: ApiLimits) -> tuple[type[BaseModel], type[BaseModel]]:
    """(CompletionRequest, ChatCompletionRequest) for a server with these limits."""
    cap, batch = limits.max_tokens_cap, limits.max_prompts
    TokenId = Annotated[int, Field(ge=0, le=limits.vocab_size - 1)]
    TokenIds = Annotated[list[TokenId], Field(min_length=1)]
    TokenKey = Annotated[str, Field(pattern=_decimal_up_to(limits.vocab_size - 1))]
    Stops = Annotated[NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOPS)] | None,
                      _one_message(f"must be a non-empty string or a list of at most {MAX_STOPS} non-empty strings"),
                      Field(description="stop strings; the text ends before the first one")]

    class Common(BaseModel):
        model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=STREAM_OPTIONS_NEED_STREAM)

        model: Annotated[Text, Field(json_schema_extra={"enum": list(limits.served_names)},
                                     description="a served model (GET /v1/models); another name gets a 404")]
        temperature: _opt(float, Field(ge=0.0, le=MAX_TEMPERATURE, description=(
            "below 1e-5: greedy; default: the server's (the model's generation_config.json, else 1)"))) = None
        top_p: _opt(float, Field(gt=0.0, le=1.0)) = None
        n: _opt(int, Field(ge=1, le=limits.max_n, description="samples of the prompt, each its own choice")) = 1
        stream: bool | None = False
        stream_options: StreamOptions | None = None
        stop: Stops = None
        seed: _opt(int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1], description=(
            "sample i draws from seed + i; -1 means unseeded (as in vLLM)"))) = None
        user: Text | None = None
        frequency_penalty: _opt(float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY, description=(
            "subtracted from a token's logit once per time it occurs in the output so far"))) = None
        presence_penalty: _opt(float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY, description=(
            "subtracted from a token's logit once it occurs in the output"))) = None
        logit_bias: _opt(dict[TokenKey, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]], Field(
            description="token id (as a string) → a bias added to its logit before sampling",
            json_schema_extra={"additionalProperties": False})) = None  # a key that is no token id is refused
        # vLLM extensions
        ignore_eos: bool | None = False
        min_tokens: _opt(int, Field(ge=0, le=cap, description="EOS and stop tokens are masked until this many "
                                                              "tokens (at most max_tokens)")) = None
        top_k: _opt(int, Field(ge=-1, le=MAX_TOP_K, description="0 or -1: off; above the vocabulary: off")) = None
        stop_token_ids: list[TokenId] | None = None

        @field_validator("stream_options")
        @classmethod
        def _needs_stream(cls, value: Any, info: ValidationInfo) -> Any:
            if value is not None and not info.data.get("stream"):
                raise PydanticCustomError("stream_options", "only allowed with stream: true")
            return value

        def stop_strings(self) -> tuple[str, ...]:
            return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

        def include_usage(self) -> bool:
            return bool(self.stream_options and self.stream_options.include_usage)

        def continuous_usage(self) -> bool:
            return self.include_usage() and bool(self.stream_options.continuous_usage_stats)

    class CompletionRequest(Common):
        prompt: Annotated[NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=batch)]
                          | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=batch)],
                          _one_message("must be a non-empty string, a non-empty list of token ids in "
                                       f"[0, {limits.vocab_size}), or a list of 1 to {batch} of either kind"),
                          Field(description=f"text or token ids, or a batch of up to {batch} of one kind: each "
                                            "prompt's n samples are choices prompt index * n + sample")]
        max_tokens: _opt(int, Field(ge=0, le=cap, description=(
            "0: no generation (with echo and logprobs: the prompt's log-likelihood); prompt + max_tokens must "
            "fit the model's context"))) = min(16, cap)  # OpenAI's default
        echo: bool | None = False
        logprobs: _opt(int, Field(ge=0, le=MAX_LOGPROBS)) = None
        best_of: _opt(int, *_only(1, "best_of > 1 is not supported (vLLM V1 dropped it too): use n",
                                  {"minimum": 1, "maximum": 1})) = None
        suffix: _opt(Text, *_only("", "suffix (insertion) is not supported", {"maxLength": 0})) = None

        def prompts(self) -> list[str | list[int]]:
            """The batch's prompts (one alone is a batch of one)."""
            p = self.prompt
            return list(p) if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]

    class ChatCompletionRequest(Common):
        model_config = ConfigDict(strict=True, extra="forbid",
                                  json_schema_extra={"allOf": [STREAM_OPTIONS_NEED_STREAM, TOP_LOGPROBS_NEED_LOGPROBS]})

        messages: Annotated[list[Message], Field(min_length=1)]
        max_tokens: _opt(int, Field(ge=1, le=cap, description="deprecated name of max_completion_tokens")) = None
        max_completion_tokens: _opt(int, Field(ge=1, le=cap, description=(
            "default: the server's, at most what the context leaves after the prompt"))) = None
        logprobs: bool | None = False
        top_logprobs: _opt(int, Field(ge=0, le=MAX_LOGPROBS, description="needs logprobs: true")) = None
        response_format: ResponseFormat | None = None
        tools: _opt(list[dict[str, Any]], *_only([], "tools are not supported", {"maxItems": 0})) = None
        tool_choice: Literal["none", "auto"] | None = None
        parallel_tool_calls: bool | None = None

        def chat(self) -> list[dict]:
            out = []
            for m in self.messages:
                msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                if m.name is not None:
                    msg["name"] = m.name
                if m.tool_call_id is not None:
                    msg["tool_call_id"] = m.tool_call_id
                out.append(msg)
            return out

        def user_text(self) -> str:
            """The last user turn: what the length predictor reads."""
            for m in reversed(self.messages):
                if m.role == "user":
                    return m.text()
            return self.messages[-1].text()

    return CompletionRequest, ChatCompletionRequest
