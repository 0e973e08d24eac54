"""The published schema (/openapi.json) says what the server does: errors are 400 with OpenAI's error object
(FastAPI would declare 422 and its own validation shape, which odma-serve never sends), 404 / 429 / 500 are
declared where they can happen, a full queue's 429 carries Retry-After, and /metrics is text."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from odma.server.protocol import ErrorResponse

ERROR = {"model": ErrorResponse}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "required": True,
                               "schema": {"type": "integer", "minimum": 0}}}
EVENT_STREAM = {"text/event-stream": {"schema": {"type": "string", "description": "server-sent events (stream: true)"}}}


def generate_responses(model: type) -> dict[int | str, dict[str, Any]]:
    """Responses of a generation endpoint: the answer as JSON or as an event stream, and every error."""
    return {
        200: {"model": model, "description": "the answer (application/json), or its chunks (stream: true)",
              "content": EVENT_STREAM},
        400: {**ERROR, "description": "an invalid request: malformed, out of range, unsupported, or too long to fit"},
        404: {**ERROR, "description": "the model is not served here"},
        413: {**ERROR, "description": "the request body is larger than the server accepts"},
        429: {**ERROR, "description": "the queue is full", "headers": RETRY_AFTER},
        500: {**ERROR, "description": "the server failed (the request is not retried)"},
    }


INFO_RESPONSES = {500: {**ERROR, "description": "the server failed"}}
METRICS_RESPONSES = {200: {"description": "Prometheus text exposition",
                           "content": {"text/plain": {"schema": {"type": "string"}}}},
                     **INFO_RESPONSES}


def install_schema(app: FastAPI, description: str) -> None:
    """Replace FastAPI's generated schema with one that matches the server's behaviour."""

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, description=description, routes=app.routes)
            for path in spec.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)  # never sent: bad bodies get a 400
            components = spec.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = schema
