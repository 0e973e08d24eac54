"""HTTP errors: the one mapping from library errors to status codes, and one body shape for every 4xx/5xx,
OpenAI's: `{"error": {"message", "type", "param", "code"}}` (FastAPI's `{"detail": ...}` never reaches a client)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from odma.errors import ConfigError, InvalidRequestError, OdmaError, RequestTooLargeError
from odma.server.protocol import ROLES

log = logging.getLogger(__name__)

KINDS = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
         413: "invalid_request_error", 429: "rate_limit_exceeded", 500: "server_error"}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str | None = None, *, param: str | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.kind = kind or KINDS.get(status, "invalid_request_error" if status < 500 else "server_error")


def http_error(exc: BaseException) -> HTTPError:
    """The one mapping from library errors to HTTP: bad input is the client's (400), the rest is ours (500)."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, RequestTooLargeError):
        return HTTPError(400, str(exc), "request_too_large")
    if isinstance(exc, (InvalidRequestError, ConfigError)):
        return HTTPError(400, str(exc))
    if isinstance(exc, OdmaError):
        return HTTPError(500, str(exc))
    return HTTPError(500, f"internal error: {type(exc).__name__}")


def _printable(text: str) -> str:
    # a message may quote client input: a lone surrogate in it must not make the error itself unencodable
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(err: HTTPError) -> dict[str, Any]:
    return {"error": {"message": _printable(err.message), "type": err.kind,
                      "param": None if err.param is None else _printable(err.param), "code": err.status}}


def error_response(err: HTTPError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)


# -- request validation messages ----------------------------------------------------------------------

def _path(loc: tuple) -> str:
    """'messages.0.content' from pydantic's location, without the union branch names it inserts (type names, and
    a message's role, which tags its model, after the message's index)."""
    loc = loc[1:]
    parts = [str(p) for i, p in enumerate(loc)
             if isinstance(p, int) or ("[" not in str(p) and str(p) not in _TYPE_TAGS
                                       and not (i and isinstance(loc[i - 1], int) and p in ROLES))]
    return ".".join(parts)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-wrap"}


def validation_error(exc: RequestValidationError, content_type: str | None = None) -> HTTPError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return HTTPError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip())
    if tuple(first.get("loc", ())) == ("body",):  # the body as a whole is not a JSON object
        return HTTPError(400, _body_message(first, content_type))
    seen, parts = set(), []
    for e in errors:
        path = _path(tuple(e.get("loc", ())))
        if path in seen:
            continue  # a union reports each branch: the first message says enough
        seen.add(path)
        parts.append(f"{path or 'body'}: {_message(e, path)}")
    param = _path(tuple(first.get("loc", ()))) or None
    return HTTPError(400, "; ".join(parts) or "invalid request", param=param)


def _body_message(error: dict, content_type: str | None) -> str:
    """What is wrong with a body that is not a JSON object: its content type, its emptiness, or its JSON type."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        return (f"the request body must be JSON sent with 'content-type: application/json' "
                f"(this request's content-type: {media or 'none'})")
    if error.get("type") == "missing":
        return "the request body is empty: send a JSON object"
    value = error.get("input")
    kind = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)
    return f"the request body must be a JSON object, not {kind}"


_TYPE_MESSAGES = {"int_type": "must be an integer", "float_type": "must be a number", "bool_type": "must be true or false",
                  "string_type": "must be a string", "list_type": "must be a list", "dict_type": "must be an object",
                  "model_type": "must be an object", "missing": "required",
                  "extra_forbidden": "unsupported parameter (docs/serving.md lists what odma-serve accepts)"}


def _message(e: dict, path: str) -> str:
    kind, ctx = e.get("type", ""), e.get("ctx") or {}
    got = repr(e.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    if kind == "less_than_equal" and path.rsplit(".", 1)[-1] in ("max_tokens", "max_completion_tokens"):
        return f"{got} exceeds this server's cap of {ctx.get('le')}"
    if kind in ("less_than_equal", "greater_than_equal", "less_than", "greater_than"):
        op = {"less_than_equal": "<=", "greater_than_equal": ">=", "less_than": "<", "greater_than": ">"}[kind]
        bound = next(iter(ctx.values()), "?")
        return f"must be {op} {bound}, got {got}"
    if kind == "string_pattern_mismatch" and path.startswith("logit_bias."):  # a key: the pattern says little
        return f"{got} is not a token id of this model's vocabulary (a decimal string without leading zeros)"
    return _TYPE_MESSAGES.get(kind) or str(e.get("msg", "invalid"))


# -- handlers -----------------------------------------------------------------------------------------

def install_error_handlers(app: FastAPI, refused) -> None:
    """Every error a client can see, in the OpenAI shape. `refused(reason)` counts requests turned away."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        refused("invalid")
        return error_response(validation_error(exc, request.headers.get("content-type")))

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(request: Request, exc: StarletteHTTPException):
        # unknown paths, wrong methods, bodies that are not UTF-8 or nest too deeply, bodies over the size limit
        message = str(exc.detail)
        if message == "There was an error parsing the body":
            message = "the request body could not be parsed (not UTF-8 JSON, or nested too deeply)"
        if exc.status_code < 500:
            refused("invalid")
        return error_response(HTTPError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    @app.exception_handler(HTTPError)
    async def _http(request: Request, exc: HTTPError):
        return error_response(exc)

    @app.exception_handler(OdmaError)
    async def _odma(request: Request, exc: OdmaError):
        err = http_error(exc)
        if err.status < 500:
            refused("too_large" if isinstance(exc, RequestTooLargeError) else "invalid")
        return error_response(err)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(http_error(exc))
