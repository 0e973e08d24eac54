"""What `odma-bench soak` sends and how each answer is classified.

A request is a `Plan`: a kind (chat or completion, streamed or not, cut by the client mid-stream, cancelled before
its first token, a long prompt, a burst member, a bad request) and its body. `send` runs one plan against the
server and returns an `Outcome`, classified as:

- `full`: a whole answer (a finish_reason and usage; a stream also ended with [DONE]);
- `cut`: the client closed the stream on purpose after some tokens; `cancelled`: the client gave up before the
  first token (both are the client's doing, not failures);
- `refused`: 429 (`retry_after` says whether the Retry-After header came with it);
- `rejected`: a 4xx other than 429 to a request built to be bad (its reason kept); `bad_accepted`: a bad
  request that was answered 2xx; `unexpected_4xx`: a 4xx to a good request;
- `server_error`: a 5xx, or a stream that ended with an error event;
- `lost`: a connection error, a timeout, a stream that stopped without finishing, a 200 whose body is not an answer.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

# the kinds of the steady mix and their shares (bursts, long prompts and bad requests are scheduled on their own)
MIX = (("chat", 0.26), ("chat_stream", 0.26), ("completion", 0.14), ("completion_stream", 0.14),
       ("cut_stream", 0.10), ("cancel_early", 0.04), ("long_prompt", 0.02), ("bad", 0.04))
OUTCOMES = ("full", "cut", "cancelled", "refused", "rejected", "bad_accepted", "unexpected_4xx", "server_error",
            "lost")
FAILURES = ("bad_accepted", "unexpected_4xx", "server_error", "lost")


@dataclass(frozen=True, slots=True)
class Plan:
    kind: str
    path: str  # /v1/chat/completions or /v1/completions
    body: dict | None  # None: `raw` is sent as it is (malformed JSON)
    stream: bool
    raw: bytes | None = None
    cut_after_tokens: int = 0  # cut_stream: close the stream after this many content chunks
    cancel_after_s: float = 0.0  # cancel_early: give up this soon after sending, before any token
    expect_4xx: bool = False
    max_tokens: int = 0


@dataclass(slots=True)
class Outcome:
    kind: str
    outcome: str
    start_s: float  # seconds since the soak began
    end_s: float
    status: int | None = None
    ttft_s: float | None = None
    tokens: int = 0
    max_tokens: int = 0
    finish: str | None = None
    reason: str = ""
    retry_after: str | None = None

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s

    def to_json(self) -> dict:
        d = asdict(self)
        d["latency_s"] = round(self.latency_s, 4)
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items() if v not in (None, "")}


@dataclass
class Prompts:
    """Natural prompts with their realized lengths (the trace's answer length is the request's max_tokens)."""

    records: list  # TraceRecord with a prompt and output_tokens
    long_prompts: list[str] = field(default_factory=list)  # thousands of tokens each

    @classmethod
    def from_traces(cls, spec: str, *, max_tokens_cap: int, long_prompt_tokens: int, seed: int,
                    limit: int | None = 2000) -> "Prompts":
        from odma.traces import load_trace

        records = [r for part in spec.split(",") if part.strip()
                   for r in load_trace(part.strip(), limit=limit).records if r.prompt and r.output_tokens]
        if not records:
            raise ValueError(f"trace {spec!r} has no prompts with realized lengths")
        rng = random.Random(seed)
        rng.shuffle(records)
        for r in records:
            r.output_tokens = max(1, min(r.output_tokens, max_tokens_cap))
        return cls(records, _long_prompts(records, long_prompt_tokens, rng))


def _long_prompts(records: list, tokens: int, rng: random.Random, count: int = 8) -> list[str]:
    """Prompts of about `tokens` tokens: trace prompts joined as numbered documents to summarize."""
    out = []
    for _ in range(count):
        parts, total = [], 0
        while total < tokens:
            r = rng.choice(records)
            parts.append(f"Document {len(parts) + 1}:\n{r.prompt}")
            total += r.prompt_tokens + 6
        out.append("Summarize the following documents in two sentences.\n\n" + "\n\n".join(parts))
    return out


# bad requests: (what is wrong, path, body or raw bytes); each must be answered 4xx
BAD_REQUESTS = (
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}'),
    ("not an object", "/v1/completions", b'["prompt"]'),
    ("negative temperature", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
    ("negative max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -1}),  # 0 is valid: prompt scoring
    ("max_tokens past the cap", "/v1/completions", {"prompt": "hi", "max_tokens": 10_000_000}),
    ("no messages", "/v1/chat/completions", {"max_tokens": 4}),
    ("unknown model", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "model": "no-such-model"}),
    ("top_p above 1", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 2}),
    ("n too large", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "n": 10_000}),
    ("wrong role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
)


class Planner:
    """Draws the next request of the steady mix (and the burst members) from the prompts, reproducibly."""

    def __init__(self, prompts: Prompts, model: str, seed: int, bad_requests: tuple = BAD_REQUESTS) -> None:
        self.prompts, self.model, self.bad_requests = prompts, model, bad_requests
        self.rng = random.Random(seed)
        self.burst_rng = random.Random(seed + 1)  # bursts interleave by timing: their draws stay off the mix's
        self._i = 0
        self._kinds, self._weights = zip(*MIX)

    def _record(self):
        r = self.prompts.records[self._i % len(self.prompts.records)]
        self._i += 1
        return r

    def _body(self, chat: bool, prompt: str, max_tokens: int, stream: bool) -> dict:
        body: dict = {"model": self.model, "max_tokens": max_tokens, "temperature": 0.7, "top_p": 0.95,
                      "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _plan(self, kind: str, chat: bool, stream: bool, prompt: str, max_tokens: int, **extra) -> Plan:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return Plan(kind, path, self._body(chat, prompt, max_tokens, stream), stream, max_tokens=max_tokens, **extra)

    def next(self) -> Plan:
        kind = self.rng.choices(self._kinds, self._weights)[0]
        if kind == "bad":
            what, path, body = self.rng.choice(self.bad_requests)
            if isinstance(body, bytes):
                return Plan(f"bad: {what}", path, None, False, raw=body, expect_4xx=True)
            body = {"model": self.model, **body}
            if what == "unknown model":
                body["model"] = "no-such-model"
            return Plan(f"bad: {what}", path, body, False, expect_4xx=True)
        r = self._record()
        chat = kind.startswith("chat") or self.rng.random() < 0.5
        if kind == "long_prompt":
            prompt = self.rng.choice(self.prompts.long_prompts)
            return self._plan(kind, chat, self.rng.random() < 0.5, prompt, min(r.output_tokens, 128))
        if kind == "cut_stream":
            # the client leaves after a share of the answer it would have got (needs 2+ tokens to cut between)
            n = max(2, r.output_tokens)
            return self._plan(kind, chat, True, r.prompt, n, cut_after_tokens=self.rng.randint(1, max(1, n // 2)))
        if kind == "cancel_early":
            return self._plan(kind, chat, True, r.prompt, r.output_tokens, cancel_after_s=self.rng.uniform(0.0, 0.02))
        return self._plan(kind, chat, kind.endswith("_stream"), r.prompt, r.output_tokens)

    def burst_member(self) -> Plan:
        r = self._record()
        return self._plan("burst", self.burst_rng.random() < 0.5, False, r.prompt, min(r.output_tokens, 16))


async def send(client, url: str, plan: Plan, t0: float, timeout_s: float) -> Outcome:
    """Run one plan; every way it can end is an Outcome (nothing raises but cancellation of the caller)."""
    out = Outcome(plan.kind, "lost", time.perf_counter() - t0, 0.0, max_tokens=plan.max_tokens)
    try:
        if plan.cancel_after_s:
            try:
                await asyncio.wait_for(_exchange(client, url, plan, out, t0, timeout_s), plan.cancel_after_s)
            except asyncio.TimeoutError:
                # cancelled by the client; had a token arrived first, it is a cut
                out.outcome = "cut" if out.tokens else "cancelled"
                out.reason = ""
        else:
            await asyncio.wait_for(_exchange(client, url, plan, out, t0, timeout_s), timeout_s)
    except asyncio.TimeoutError:
        out.outcome, out.reason = "lost", f"no answer within {timeout_s:.0f} s"
    except Exception as exc:  # noqa: BLE001 - a failed request is an outcome, not the soak's end
        out.outcome, out.reason = "lost", f"{type(exc).__name__}: {exc}"[:300]
    out.end_s = time.perf_counter() - t0
    return out


async def _exchange(client, url: str, plan: Plan, out: Outcome, t0: float, timeout_s: float) -> None:
    kwargs: dict = {"timeout": timeout_s}
    if plan.body is None:
        kwargs.update(content=plan.raw, headers={"content-type": "application/json"})
    else:
        kwargs["json"] = plan.body
    async with client.stream("POST", url + plan.path, **kwargs) as r:
        out.status = r.status_code
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            _classify_refusal(plan, out, r.status_code, text, r.headers.get("retry-after"))
            return
        if plan.expect_4xx:
            await r.aread()
            out.outcome, out.reason = "bad_accepted", "answered 200"
            return
        if plan.stream:
            await _read_stream(r, plan, out, t0)
        else:
            _read_answer(await r.aread(), out, t0)


def _classify_refusal(plan: Plan, out: Outcome, status: int, text: str, retry_after: str | None) -> None:
    try:
        reason = str(json.loads(text).get("error", {}).get("message", text))
    except (ValueError, AttributeError):
        reason = text
    out.reason = reason[:200]
    if status == 429:
        out.outcome, out.retry_after = "refused", retry_after
    elif 400 <= status < 500:
        out.outcome = "rejected" if plan.expect_4xx else "unexpected_4xx"
    elif status >= 500:
        out.outcome = "server_error"
    else:
        out.outcome = "lost"


def _read_answer(raw: bytes, out: Outcome, t0: float) -> None:
    try:  # no TTFT: a whole answer arrives at once
        body = json.loads(raw)
        choice = body["choices"][0]
        out.finish, out.tokens = choice["finish_reason"], int(body["usage"]["completion_tokens"])
    except (ValueError, KeyError, IndexError, TypeError):
        out.outcome, out.reason = "lost", f"a 200 that is not an answer: {raw[:200]!r}"
        return
    out.outcome = "full" if out.finish else "lost"


async def _read_stream(r, plan: Plan, out: Outcome, t0: float) -> None:
    done = False
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        chunk = json.loads(line[6:])
        if "error" in chunk:
            out.outcome, out.reason = "server_error", str(chunk["error"].get("message", chunk["error"]))[:300]
            return
        for ch in chunk.get("choices") or []:
            text = (ch.get("delta") or {}).get("content") if "delta" in ch else ch.get("text")
            if text:
                if out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - t0 - out.start_s
                out.tokens += 1  # content chunks (a chunk is one token or a few; usage has the count)
            out.finish = ch.get("finish_reason") or out.finish
        if chunk.get("usage"):
            out.tokens = int(chunk["usage"]["completion_tokens"])
        if plan.cut_after_tokens and out.tokens >= plan.cut_after_tokens and not out.finish:
            out.outcome = "cut"  # leaving the `async with` closes the connection mid-stream
            return
    if done and out.finish:
        out.outcome = "full"
    else:
        out.outcome, out.reason = "lost", "the stream stopped without a finish_reason and [DONE]"
