"""The request body size limit, answered in OpenAI's error shape: a body that says it is too large is refused
(413) before a byte of it is read; one that turns out too large while it streams in is refused when it passes the
limit. (Starlette's own limit answers in plain text, replacing any JSON error.)"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from odma.server.errors import HTTPError, error_response


class BodyLimit:
    """ASGI middleware: bodies over `max_bytes` get a 413 whose message says why the limit is what it is."""

    def __init__(self, app: ASGIApp, max_bytes: int, why: str) -> None:
        self.app, self.max_bytes, self.why = app, max_bytes, why

    def _message(self) -> str:
        return f"the request body is larger than {self.max_bytes:,} bytes, {self.why}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(HTTPError(413, self._message()))(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # raised inside the app: its error handlers answer in the API's shape
                raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited, send)
