"""The FastAPI app: OpenAI routes, health and metrics. Errors map to HTTP statuses in one place (`_status`)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from odma.errors import ConfigError, InvalidRequestError, OdmaError, RequestTooLargeError
from odma.server.metrics import Metrics
from odma.server.protocol import ChatCompletionRequest, CompletionRequest
from odma.server.runtime import AsyncEngine

DISCONNECT_POLL_S = 0.5


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


def _status(exc: Exception) -> HTTPError:
    """The one mapping from library errors to HTTP."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, RequestTooLargeError):
        return HTTPError(400, str(exc), "request_too_large")
    if isinstance(exc, (InvalidRequestError, ConfigError)):
        return HTTPError(400, str(exc))
    if isinstance(exc, OdmaError):
        return HTTPError(500, str(exc), "server_error")
    return HTTPError(500, f"internal error: {type(exc).__name__}", "server_error")


def _error_body(err: HTTPError) -> dict:
    return {"error": {"message": err.message, "type": err.kind, "code": err.status}}


def create_app(runtime: AsyncEngine, metrics: Metrics, model_name: str, aliases: tuple[str, ...] = ()) -> FastAPI:
    engine = runtime.engine
    names = {model_name, *aliases}
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runtime.start()
        yield
        runtime.stop()

    app = FastAPI(title="odma-serve", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        if errs and errs[0].get("type") == "json_invalid":
            msg = f"request body is not valid JSON: {errs[0].get('ctx', {}).get('error', '')}".strip()
        else:
            msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in errs)
        metrics.refused("invalid")
        return JSONResponse(_error_body(HTTPError(400, msg)), status_code=400)

    @app.exception_handler(HTTPError)
    async def _http(request: Request, exc: HTTPError):
        return JSONResponse(_error_body(exc), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(OdmaError)
    async def _odma(request: Request, exc: OdmaError):
        err = _status(exc)
        metrics.refused("too_large" if isinstance(exc, RequestTooLargeError) else "invalid")
        return JSONResponse(_error_body(err), status_code=err.status)

    def check(body) -> None:
        if body.model not in names:
            raise HTTPError(404, f"model {body.model!r} is not served here; available: {sorted(names)}", "model_not_found")
        if runtime.queue_full:
            metrics.refused("queue_full")
            raise HTTPError(429, f"server busy: {runtime.max_queue} requests already queued; retry later",
                            "rate_limit_exceeded", headers={"Retry-After": "1"})

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "policy": engine.config.policy,
                "running": engine.num_running, "waiting": engine.num_waiting}

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "odma"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check(body)
        prompt = body.prompt_input()
        params = body.sampling(body.max_tokens, engine.config.default_max_tokens)
        return await _respond(request, body, prompt, params, prompt if isinstance(prompt, str) else None, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check(body)
        messages = body.chat()
        if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
            raise HTTPError(400, "this model has no chat template; use /v1/completions")
        try:
            text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - templates raise on bad role orders etc.
            raise HTTPError(400, f"cannot apply the chat template: {exc}") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling(max_tokens, engine.config.default_max_tokens)
        tags = body.tags(lambda reply: len(engine.tokenizer.encode(reply, add_special_tokens=False)))
        return await _respond(request, body, text, params, body.user_text(), chat=True, tags=tags)

    async def _respond(request: Request, body, prompt, params, predictor_text, chat: bool, tags=None):
        handle = runtime.submit(prompt, params, prompt_text=predictor_text, tags=tags)  # 4xx raise here, nothing queued
        texts = _TextStream(engine, body.stop_strings(), params.min_tokens)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if body.stream:
            gen = _sse(runtime, handle, texts, rid, model_name, chat, body.include_usage())
            return StreamingResponse(gen, media_type="text/event-stream")
        return await _collect(request, runtime, handle, texts, rid, model_name, chat)

    return app


class _TextStream:
    """Incremental detokenisation with stop strings: `push(token)` returns the new text that is safe to send."""

    def __init__(self, engine, stops: list[str], min_tokens: int = 0) -> None:
        self.engine, self.stops, self.min_tokens = engine, stops, min_tokens
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False
        self._counted_from = 0  # stop strings ending before min_tokens were reached do not count (as in vLLM)

    def push(self, token: int | None) -> str:
        if token is not None and not self.stopped:
            self.ids.append(token)
        text = self.engine.decode(self.ids)
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
        if self.stopped:
            return ""
        text = self.engine.decode(self.ids)
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent += delta
        return delta


def _finish_reason(seq, texts: _TextStream) -> str:
    if texts.stopped:
        return "stop"
    return {"stop": "stop", "length": "length"}.get(seq.finish_reason, seq.finish_reason or "stop")


def _usage(seq) -> dict:
    n = len(seq.prompt_ids)
    return {"prompt_tokens": n, "completion_tokens": seq.num_generated, "total_tokens": n + seq.num_generated}


async def _collect(request, runtime, handle, texts, rid, model, chat):
    seq = None
    stream = runtime.events(handle)
    watcher = asyncio.create_task(_watch_disconnect(request))
    try:
        while True:
            nxt = asyncio.ensure_future(stream.__anext__())
            done, _ = await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:  # the client left: cancelling the wait cancels the request and frees its block
                nxt.cancel()
                try:
                    await nxt
                except (asyncio.CancelledError, StopAsyncIteration):
                    pass
                return Response(status_code=499)
            try:
                ev = nxt.result()
            except StopAsyncIteration:
                break
            seq = ev.seq
            texts.push(ev.token)
            if texts.stopped:
                runtime.finish_early(seq.request_id)
                break
    finally:
        watcher.cancel()
        await stream.aclose()
    if seq.finish_reason == "error":
        raise HTTPError(500, f"generation failed: {seq.error}", "server_error")
    text = texts.sent + texts.flush()
    reason = _finish_reason(seq, texts)
    created = int(time.time())
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason, "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": _usage(seq)}


async def _watch_disconnect(request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _sse(runtime, handle, texts, rid, model, chat, include_usage):
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta_text: str | None, reason: str | None, role: bool = False) -> str:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if delta_text:
                delta["content"] = delta_text
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta_text or "", "finish_reason": reason, "logprobs": None}
        body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    seq = None
    stream = runtime.events(handle)
    try:
        if chat:
            yield chunk(None, None, role=True)
        async for ev in stream:
            seq = ev.seq
            delta = texts.push(ev.token)
            if texts.stopped:
                runtime.finish_early(seq.request_id)
            if ev.finished or texts.stopped:
                delta += texts.flush()
                if seq.finish_reason == "error":
                    err = {"error": {"message": f"generation failed: {seq.error}", "type": "server_error", "code": 500}}
                    yield f"data: {json.dumps(err)}\n\n"
                    break
                if delta:
                    yield chunk(delta, None)
                yield chunk(None, _finish_reason(seq, texts))
                break
            if delta:
                yield chunk(delta, None)
        if include_usage and seq is not None:
            usage = {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": _usage(seq)}
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await stream.aclose()  # a client that disconnects lands here: the request is cancelled
