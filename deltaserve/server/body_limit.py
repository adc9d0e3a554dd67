"""A cap on the size of request bodies: HTTP 413 with an OpenAI-style error body past it.

`Content-Length` is checked before anything is read; a body without it (chunked transfer) is
counted as it arrives and refused as soon as it passes the cap. A body under the cap is read
whole and handed to the app unchanged (FastAPI reads it whole anyway). Before a 413 the rest of
the refused body is read and dropped (up to `DRAIN_LIMIT` bytes), so that a client still
sending gets the answer rather than a reset connection; a client that waits for
`100 Continue` is answered at once and never sends the body.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deltaserve.server import DEFAULT_MAX_REQUEST_BYTES
from deltaserve.server.errors import error_response

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "DRAIN_LIMIT", "BodySizeLimitMiddleware"]
DRAIN_LIMIT = 64 * 1024 * 1024  # bytes of a refused body read and dropped before the 413


class BodySizeLimitMiddleware:
    """Refuse (413) a request whose body is larger than `max_bytes`."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_request_bytes must be > 0, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length", "").strip()
        if length.isdigit() and int(length) > self.max_bytes:
            expects_continue = headers.get("expect", "").lower() == "100-continue"
            if not expects_continue and int(length) <= DRAIN_LIMIT:
                await _drain(receive, DRAIN_LIMIT)
            await self._refuse(scope, receive, send, f"{int(length)} bytes")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await _drain(receive, DRAIN_LIMIT)
                await self._refuse(scope, receive, send, f"more than {self.max_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        response = error_response(
            f"the request body is too large ({size}; this server accepts at most "
            f"{self.max_bytes} bytes, set by --max-request-bytes)",
            413,
        )
        response.headers["Connection"] = "close"  # the rest of the body is not read
        await response(scope, receive, send)


async def _drain(receive: Receive, limit: int) -> None:
    """Read and drop the rest of a request body (at most `limit` bytes)."""
    size = 0
    while size <= limit:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        size += len(message.get("body", b""))


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A `receive` that returns `messages` first, then what the client sends next (e.g. its
    disconnect, which the handlers watch for)."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
