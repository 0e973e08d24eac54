"""The FastAPI app: OpenAI routes, health and metrics. Library errors map to HTTP statuses in one place
(`errors.http_error`); requests become engine jobs in `jobs.py`; answers are built in `streams.py`."""

# no `from __future__ import annotations`: FastAPI reads the request models (built per server) from the handlers'
# annotations at run time

import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from odma.server.admission import RETRY_AFTER_S, Pass, busy_message
from odma.server.body_limit import BodyLimit
from odma.server.errors import HTTPError, install_error_handlers
from odma.server.generation_config import SamplingDefaults
from odma.server.jobs import Job, JobBuilder, max_prompt_chars
from odma.server.metrics import Metrics
from odma.server.openapi import HEALTH_RESPONSES, INFO_RESPONSES, METRICS_RESPONSES, MODEL_RESPONSES, generate_responses, install_schema
from odma.server.protocol import ApiLimits, request_models
from odma.server.responses import ChatCompletionResponse, CompletionResponse, Health, ModelCard, ModelList
from odma.server.render import TokenText
from odma.server.runtime import SHUTTING_DOWN, Offload
from odma.server.served_engine import ServedRuntime
from odma.server.streams import Sample, collect, sse

MAX_BODY_BYTES = 64 << 20  # without a tokenizer (token ids only), as with one: far above any prompt that fits
BODY_BYTES_PER_CHAR = 12  # JSON spells a character outside the BMP as two \uXXXX escapes
BODY_SLACK_BYTES = 1 << 20  # the other fields
DEFAULT_MAX_N = 16

DESCRIPTION = """OpenAI-compatible completions and chat completions served by odma: every request's KV cache is
one contiguous block sized from a predicted generation length. Every error is `{"error": {"message", "type",
"param", "code"}}`. Limits that JSON Schema cannot state: prompt + max_tokens must fit the model's context and
the KV pool's largest block; min_tokens <= max_tokens; top_logprobs needs logprobs: true."""


def create_app(runtime: ServedRuntime, metrics: Metrics, model_name: str, aliases: tuple[str, ...] = (),
               defaults: SamplingDefaults | None = None, max_n: int = DEFAULT_MAX_N) -> FastAPI:
    engine = runtime.engine
    names = tuple(dict.fromkeys((model_name, *aliases)))
    limits = ApiLimits(served_names=names, vocab_size=engine.vocab_size,
                       max_tokens_cap=engine.config.max_tokens_cap, max_n=max_n,
                       default_max_tokens=engine.config.default_max_tokens,
                       max_prompt_chars=max_prompt_chars(engine.tokenizer, engine.max_model_len))
    offload = Offload()
    # a body that cannot hold a prompt that fits is refused (413) before it is read, let alone parsed on the loop
    body_bytes = (MAX_BODY_BYTES if limits.max_prompt_chars is None
                  else BODY_BYTES_PER_CHAR * limits.max_prompt_chars + BODY_SLACK_BYTES)
    app = FastAPI(title="odma-serve", version="0.1.0", lifespan=_lifespan(runtime, offload))
    app.add_middleware(BodyLimit, max_bytes=body_bytes, why="more than any prompt that fits this server's context needs")
    install_error_handlers(app, metrics.refused)
    _info_routes(app, runtime, metrics, model_name, names)
    _generation_routes(app, runtime, metrics, limits, JobBuilder(engine, limits, defaults or SamplingDefaults()),
                       model_name, offload)
    install_schema(app, DESCRIPTION)
    return app


def _lifespan(runtime: ServedRuntime, offload: Offload):
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runtime.start()
        yield
        runtime.stop()
        offload.close()

    return lifespan


def _info_routes(app: FastAPI, runtime: ServedRuntime, metrics: Metrics, model_name: str,
                 served_names: tuple[str, ...]) -> None:
    engine = runtime.engine
    created = int(time.time())

    @app.get("/health", response_model=Health, responses=HEALTH_RESPONSES)
    async def health():
        if not runtime.alive:
            raise HTTPError(503, "the engine is not running: its loop or its process ended (the server log says why)")
        return {"status": "ok", "model": model_name, "policy": engine.config.policy,
                "running": engine.num_running, "waiting": runtime.waiting}

    @app.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "odma",
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models", response_model=ModelList, responses=INFO_RESPONSES)
    async def models():
        return {"object": "list", "data": [card(model_name)]}

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=MODEL_RESPONSES)
    async def model(model_id: str):
        """One served model (its aliases too: the names requests may use); 404 for another name."""
        if model_id not in served_names:
            raise HTTPError(404, f"model {model_id!r} is not served here; available: {list(served_names)}",
                            "model_not_found", param="model")
        return card(model_id)


def _generation_routes(app: FastAPI, runtime: ServedRuntime, metrics: Metrics, limits: ApiLimits, jobs: JobBuilder,
                       model_name: str, offload: Offload) -> None:
    Completion, Chat = request_models(limits)
    texts = TokenText(runtime.engine.tokenizer)

    def admit(body, samples: int) -> Pass:
        """503 once the server is stopping, 404 for a model not served here, 429 when the queue has no room for the
        request's samples; else the request's places in the queue, taken now (before it is tokenized: requests
        arriving together must not all see the room that only some of them can have)."""
        if runtime.closing:
            raise HTTPError(503, SHUTTING_DOWN)
        if body.model not in limits.served_names:
            raise HTTPError(404, f"model {body.model!r} is not served here; available: {list(limits.served_names)}",
                            "model_not_found", param="model")
        admitted = runtime.admit(samples)
        if admitted is None:
            metrics.refused("queue_full")
            raise HTTPError(429, busy_message(runtime.max_queue), headers={"Retry-After": str(RETRY_AFTER_S)})
        return admitted

    async def built(admitted: Pass, build, body):
        """What `build` (a JobBuilder method) makes of the body, off the event loop; the places are given back if
        it fails."""
        try:
            return await offload(build, body)
        except BaseException:  # refused by validation, or the client left while it was tokenized
            admitted.release()
            raise

    def submit(batch: list[Job], admitted: Pass) -> list:
        """Every prompt's samples queued, each with its share of the places; one that cannot be queued (the server
        stopping) cancels those queued before it."""
        handles = []
        try:
            for job in batch:
                handles.append(runtime.submit(job.prompt_ids, job.params, n=job.n, prompt_text=job.prompt_text,
                                              tags=job.tags, admitted=admitted.split(job.n)))
        except BaseException:
            admitted.release()
            for handle in handles:
                runtime.cancel(handle)
            raise
        return handles

    async def answer(request: Request, batch: list[Job], admitted: Pass):
        handles = submit(batch, admitted)
        samples = [Sample(i * job.n + j, job, runtime.engine, texts) for i, job in enumerate(batch)
                   for j in range(job.n)]
        rid = f"{'chatcmpl' if batch[0].chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if batch[0].stream:
            return StreamingResponse(sse(runtime, handles, batch, samples, rid, model_name, offload),
                                     media_type="text/event-stream")
        return await collect(request, runtime, handles, batch, samples, rid, model_name, offload)

    @app.post("/v1/completions", response_model=None, responses=generate_responses(CompletionResponse))
    async def completions(body: Completion, request: Request):
        admitted = admit(body, (body.n or 1) * len(body.prompts()))
        return await answer(request, await built(admitted, jobs.completions, body), admitted)

    @app.post("/v1/chat/completions", response_model=None, responses=generate_responses(ChatCompletionResponse))
    async def chat(body: Chat, request: Request):
        admitted = admit(body, body.n or 1)
        return await answer(request, [await built(admitted, jobs.chat, body)], admitted)
