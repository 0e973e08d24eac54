"""Turning a job's engine events into its answer: one `Sample` per choice (text with stop strings applied, the
logprobs not sent yet), collected into one body or streamed as server-sent events."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator

from fastapi.responses import Response

from odma.server import render
from odma.server.detokenizer import IncrementalText, rewrites_text
from odma.server.errors import HTTPError, error_body
from odma.server.jobs import Job
from odma.server.runtime import SHUTTING_DOWN
from odma.server.served_engine import ServedEngine

DISCONNECT_POLL_S = 0.5


class TextStream:
    """Incremental detokenisation with stop strings: `push(token)` returns the new text that is safe to send."""

    def __init__(self, engine: ServedEngine, stops: tuple[str, ...], min_tokens: int = 0) -> None:
        self.engine, self.stops, self.min_tokens = engine, stops, min_tokens
        whole = rewrites_text(getattr(engine, "tokenizer", None), engine.decode)
        self._text = IncrementalText(engine.decode, full_decode=whole)
        self.ids: list[int] = self._text.ids
        self.sent = ""
        self.stopped = False
        self._counted_from = 0  # stop strings ending before min_tokens were reached do not count (as in vLLM)

    def push(self, token: int | None) -> str:
        if token is not None and not self.stopped:
            self._text.push(token)
        text = self._text.text
        if self.stops and len(self.ids) < self.min_tokens:
            self._counted_from = len(text)
        elif self.stops:
            hits = [i for s in self.stops if (i := text.find(s, max(0, self._counted_from - len(s) + 1))) >= 0]
            if hits:
                text, self.stopped = text[: min(hits)], True
            else:  # hold back a tail that could start a stop string
                hold = max((len(s) - 1 for s in self.stops), default=0)
                text = text[: max(len(self.sent), len(text) - hold)] if hold else text
        if text.endswith("\ufffd"):  # half a multi-byte character: wait for the rest
            text = text[:-1]
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent += delta
        return delta

    def flush(self) -> str:
        """The rest of the text at the end. A reply cut inside a multi-byte character ends before it: its partial
        bytes are held back, as vLLM's detokenizer does, rather than sent as U+FFFD."""
        if self.stopped:
            return ""
        text = self._text.text.removesuffix("\ufffd")
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent += delta
        return delta


class StopWatch:
    """Stop strings watched where the engine runs apart from the answer (an engine process, a Ray replica): each
    sample's tokens pushed through the same `TextStream` the answer uses, so the engine ends the sample at the token
    where the answer's text sees the stop string (its realized length logged as the answer's)."""

    def __init__(self, engine: ServedEngine, params, n: int) -> None:
        self._texts = ({i: TextStream(engine, params.stop, params.min_tokens) for i in range(n)}
                       if params.stop else None)

    def stopped_by(self, index: int, token: int | None) -> bool:
        """Whether `token` completes a stop string of sample `index` (once: later tokens say no)."""
        if self._texts is None or token is None or self._texts[index].stopped:
            return False
        text = self._texts[index]
        text.push(token)
        return text.stopped


class Sample:
    """One choice of a job: its text so far and the logprobs entries already sent."""

    def __init__(self, index: int, job: Job, engine: ServedEngine, texts: render.TokenText) -> None:
        self.index, self.job, self.engine, self.texts = index, job, engine, texts
        self.text = TextStream(engine, job.params.stop, job.params.min_tokens)
        self.seq = None
        self.finished = False
        self.ending = False  # a stop string matched: the engine was asked to end it
        self._sent_entries = 0
        self._offset = len(job.echo or "")  # completions' text_offset of the next generated token

    def end_early(self, runtime) -> None:
        """A stop string matched: end the request in the engine too (once), as a normal completion."""
        if self.text.stopped and not self.finished and not self.ending:
            self.ending = True
            runtime.finish_early(self.seq.request_id)

    def push(self, token: int | None, finished: bool) -> str:
        """The new text after this event (nothing for max_tokens 0, whose one token is not sent)."""
        if not self.job.generate:
            self.finished = finished
            return ""
        delta = self.text.push(token)
        if finished or self.text.stopped:
            delta += self.text.flush()
        self.finished = finished
        return delta

    @property
    def finish_reason(self) -> str:
        if not self.job.generate:
            return "length"
        if self.text.stopped:
            return "stop"
        return {"stop": "stop", "length": "length"}.get(self.seq.finish_reason, "stop")

    @property
    def completion_tokens(self) -> int:
        return self.seq.num_generated if self.job.generate else 0

    def _generated_entries(self) -> tuple[list, list[int]]:
        """Entries and tokens of the text so far not reported yet: one per generated token, EOS included (an
        evaluation harness reads the last entry as the generated token's; EOS shows as empty text)."""
        if self.job.logprobs is None or not self.job.generate or not self.seq.output_logprobs:
            return [], []
        entries = self.seq.output_logprobs[self._sent_entries:len(self.text.ids)]
        self._sent_entries = max(self._sent_entries, min(len(self.text.ids), len(self.seq.output_logprobs)))
        return entries, [e.token for e in entries]

    def prompt_logprobs(self) -> dict[str, Any] | None:
        """Completions with echo: the prompt's part of the legacy logprobs object."""
        first = self.seq.samples[0] if self.seq.samples else self.seq
        entries = first.prompt_logprobs or [None] * len(self.job.prompt_ids)
        out, _ = render.completion_logprobs(entries, self.job.prompt_ids, self.texts, 0)
        return out

    def new_logprobs(self) -> Any:
        """The logprobs of the tokens since the last call, in the job's form (None when not asked)."""
        if self.job.logprobs is None:
            return None
        entries, tokens = self._generated_entries()
        eos = self.engine.eos_ids
        if self.job.chat:
            return {"content": render.chat_logprobs(entries, self.texts, eos)}
        out, self._offset = render.completion_logprobs(entries, tokens, self.texts, self._offset, eos)
        return out


def _merge(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}


def choice_body(sample: Sample) -> dict[str, Any]:
    job = sample.job
    logprobs = sample.new_logprobs()
    if job.chat:
        return {"index": sample.index, "message": {"role": "assistant", "content": sample.text.sent},
                "finish_reason": sample.finish_reason, "logprobs": logprobs}
    if job.echo is not None and job.logprobs is not None:
        logprobs = _merge(sample.prompt_logprobs(), logprobs)
    return {"index": sample.index, "text": (job.echo or "") + sample.text.sent, "finish_reason": sample.finish_reason,
            "logprobs": logprobs}


def _failure(samples: list[Sample]) -> HTTPError | None:
    """The error of a failed sample: 503 when the server stopping cut it short, else 500."""
    for s in samples:
        if s.seq is not None and s.seq.finish_reason == "error":
            if s.seq.error == SHUTTING_DOWN:
                return HTTPError(503, SHUTTING_DOWN)
            return HTTPError(500, f"generation failed: {s.seq.error}")
    return None


async def _inline(fn, *args):
    return fn(*args)


async def batch_events(runtime, handles: list) -> AsyncIterator[tuple[int, Any]]:
    """(prompt index, event) for the events of every handle of a request, as they come. Leaving early (the client
    gone, or a cancelled wait) closes every handle's events, which cancels what still runs."""
    streams = [runtime.events(h) for h in handles]
    if len(streams) == 1:  # one prompt: its own stream, no task per event
        try:
            async for ev in streams[0]:
                yield 0, ev
        finally:
            await streams[0].aclose()
        return
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=pending.__getitem__):
                i = pending.pop(fut)
                try:
                    ev = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, ev
    finally:
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)  # each cancelled wait cancels its handle's samples
        for s in streams:
            await s.aclose()


def _prompt_tokens(jobs: list[Job]) -> int:
    return sum(len(j.prompt_ids) for j in jobs)


async def collect(request, runtime, handles: list, jobs: list[Job], samples: list[Sample], rid: str, model: str,
                  offload=_inline):
    """The whole answer as one body: the choices of every prompt (`handles[i]` runs `jobs[i]`, its samples are
    `samples[i * n:(i + 1) * n]`); a client that leaves first cancels them all (their blocks are freed). The body
    is rendered by `offload` (off the event loop: a long prompt's echoed logprobs take a while)."""
    job, n = jobs[0], jobs[0].n
    stream = batch_events(runtime, handles)
    watcher = asyncio.create_task(_watch_disconnect(request))
    nxt = None
    try:
        while True:
            nxt = asyncio.ensure_future(stream.__anext__())
            done, _ = await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:  # the client left: the wait is cancelled below, which cancels the jobs
                return Response(status_code=499)
            try:
                prompt, ev = nxt.result()
            except StopAsyncIteration:
                break
            sample = samples[prompt * n + ev.seq.index]
            sample.seq = ev.seq
            sample.push(ev.token, ev.finished)
            sample.end_early(runtime)
    finally:
        watcher.cancel()
        # a wait still pending (the client left, or Ray Serve cancelled this task) ends first: closing the stream it
        # runs in would fail, and nothing would be cancelled
        if nxt is not None and not nxt.done():
            nxt.cancel()
            await asyncio.gather(nxt, return_exceptions=True)  # cancelling it cancels the jobs, frees their blocks
        await stream.aclose()
    failure = _failure(samples)
    if failure:
        raise failure

    def body() -> dict[str, Any]:
        out = render.envelope(rid, job.chat, int(time.time()), model, [choice_body(s) for s in samples])
        out["usage"] = render.usage(_prompt_tokens(jobs), sum(s.completion_tokens for s in samples))
        return out

    return await offload(body)


async def _watch_disconnect(request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def sse(runtime, handles: list, jobs: list[Job], samples: list[Sample], rid: str, model: str,
              offload=_inline) -> AsyncIterator[str]:
    """The answer as server-sent events (`handles`, `jobs`, `samples` as `collect` takes them): per choice a first
    chunk (the role, or the echoed prompt), its text and logprobs as they come, a last chunk with its finish
    reason; usage at the end when asked; [DONE]. The echoed prompt's logprobs are rendered by `offload`."""
    created = int(time.time())
    job, n = jobs[0], jobs[0].n

    def usage_so_far() -> dict[str, int]:
        return render.usage(_prompt_tokens(jobs), sum(s.completion_tokens for s in samples if s.seq))

    def event(choices: list[dict], **extra: Any) -> str:
        body = render.envelope(rid, job.chat, created, model, choices, chunk=True)
        if job.include_usage:
            body["usage"] = usage_so_far() if job.usage_every_chunk else None
        body.update(extra)
        return f"data: {json.dumps(body)}\n\n"

    text_chunk = None if job.include_usage and job.usage_every_chunk else \
        render.TextChunk(rid, job.chat, created, model, null_usage=job.include_usage)

    def chunk(sample: Sample, text: str | None, reason: str | None, logprobs: Any = None, role: bool = False) -> str:
        if text and reason is None and logprobs is None and not role and text_chunk is not None:
            return text_chunk(sample.index, text)
        if job.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": sample.index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": sample.index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        return event([choice])

    stream = batch_events(runtime, handles)
    try:
        for s in samples:
            if job.chat:
                yield chunk(s, None, None, role=True)
            elif s.job.echo is not None:
                yield chunk(s, s.job.echo, None, None)  # its logprobs come with the first event (the prompt is scored)
        echoed_logprobs: set[int] = set()
        async for prompt, ev in stream:
            sample = samples[prompt * n + ev.seq.index]
            sample.seq = ev.seq
            delta = sample.push(ev.token, ev.finished)
            sample.end_early(runtime)
            if ev.finished and ev.seq.finish_reason == "error":
                yield f"data: {json.dumps(error_body(_failure([sample])))}\n\n"
                break
            logprobs = sample.new_logprobs()
            if sample.job.echo is not None and job.logprobs is not None and sample.index not in echoed_logprobs:
                echoed_logprobs.add(sample.index)
                logprobs = _merge(await offload(sample.prompt_logprobs), logprobs)
            if delta or _has_entries(logprobs):
                yield chunk(sample, delta, None, logprobs)
            if ev.finished:
                yield chunk(sample, None, sample.finish_reason)
        else:
            if job.include_usage:
                yield event([], usage=usage_so_far())
        yield "data: [DONE]\n\n"
    finally:
        await stream.aclose()  # a client that disconnects lands here: every prompt's samples are cancelled


def _has_entries(logprobs: Any) -> bool:
    if not logprobs:
        return False
    return bool(logprobs.get("content") if "content" in logprobs else logprobs.get("tokens"))
