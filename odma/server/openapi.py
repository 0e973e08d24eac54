"""The published schema (/openapi.json) says what the server does: errors are 400 with OpenAI's error object
(FastAPI would declare 422 and its own validation shape, which odma-serve never sends), 404 / 429 / 500 are
declared where they can happen, a full queue's 429 carries Retry-After, and /metrics is text.

It is OpenAPI 3.0, as OpenAI's own: there `type: integer` means an integer spelled as one, so `max_tokens: 5.0`
is outside the schema as it is outside the server (in OpenAPI 3.1's JSON Schema 5.0 *is* an integer).
FastAPI writes 3.1; `as_openapi_30` rewrites the few 3.1 spellings it uses."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from odma.engine.sampling import SEED_RANGE
from odma.server.responses import ErrorResponse

ERROR = {"model": ErrorResponse}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "required": True,
                               "schema": {"type": "integer", "minimum": 0}}}
# one server-sent event: `data` is a JSON chunk (the non-streaming body's shape, `delta` for chat), an error
# object, or the final `[DONE]`
SSE_EVENT = {"type": "object", "required": ["data"], "additionalProperties": False,
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                            "retry": {"type": "integer"}}}
EVENT_STREAM = {"text/event-stream": {"schema": SSE_EVENT}}


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
        503: {**ERROR, "description": "the server is shutting down: the request was not finished (a stream's last "
                                      "event says so)"},
    }


INFO_RESPONSES = {500: {**ERROR, "description": "the server failed"}}
HEALTH_RESPONSES = {503: {**ERROR, "description": "the engine is not running (its loop or its process ended)"},
                    **INFO_RESPONSES}
MODEL_RESPONSES = {404: {**ERROR, "description": "the model is not served here"}, **INFO_RESPONSES}
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
            app.openapi_schema = as_openapi_30(spec)
        return app.openapi_schema

    app.openapi = schema


def as_openapi_30(spec: dict[str, Any]) -> dict[str, Any]:
    """The same API in OpenAPI 3.0.3: `anyOf [X, null]` becomes `nullable`, `const` an `enum`, numeric
    `exclusiveMinimum`/`exclusiveMaximum` the boolean form."""
    out = _schema_30(spec)
    out["openapi"] = "3.0.3"
    out.pop("webhooks", None)
    return out


def _schema_30(node: Any) -> Any:
    if isinstance(node, list):
        return [_schema_30(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _schema_30(v) for k, v in node.items()}
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and {"type": "null"} in branches:
            rest = [b for b in branches if b != {"type": "null"}]
            del node[key]
            if len(rest) == 1 and "$ref" not in rest[0]:
                node = {**rest[0], **node}
            elif len(rest) == 1:
                node["allOf"] = rest  # a $ref has no siblings in 3.0
            else:
                node[key] = rest
            node["nullable"] = True
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if node.get("nullable") and isinstance(node.get("enum"), list) and None not in node["enum"]:
        node["enum"] = [*node["enum"], None]  # 3.0.3: a nullable enum lists null itself
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        value = node.get(exclusive)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            node[bound], node[exclusive] = value, True
    if node.get("type") == "integer":
        for bound in ("minimum", "maximum"):
            if isinstance(node.get(bound), float):
                node[bound] = _integer_bound(node[bound])
    return node


def _integer_bound(value: float) -> int:
    """FastAPI's schema model keeps every bound as a float: exact below 2**53, and the only integer bounds
    beyond it are int64's (seed), which come back as ±2**63."""
    if abs(value) < 2**53:
        return int(value)
    return SEED_RANGE[1] if value > 0 else SEED_RANGE[0]
