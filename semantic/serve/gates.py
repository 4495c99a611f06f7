"""ASGI middlewares around every route: refuse a request too large or while shutting down; release its models."""

from __future__ import annotations

import asyncio
from typing import Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from semantic.serve.errors import INVALID, TOO_LARGE, UNAVAILABLE, ApiError, Watched, error_response

# Still answered while shutting down: stats and scrapes show the drain; /health says 503 itself.
DRAIN_OPEN = frozenset({"/v1/cache/stats"})


def _too_large(limit: int) -> ApiError:
    return ApiError(TOO_LARGE, f"the request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large")


class BodyLimit:
    """413 for a body over ``limit`` bytes: at once from Content-Length, else while it streams in."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                err = ApiError(INVALID, f"bad Content-Length {declared!r}")
                return await error_response(scope["path"], err)(scope, receive, send)
            if int(declared) > self.limit:
                return await error_response(scope["path"], _too_large(self.limit))(scope, receive, send)
        seen = 0

        async def counting() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # a chunked body, or one longer than it said
                    raise _too_large(self.limit)  # an HTTPException: FastAPI's body parsing re-raises it
            return message

        await self.app(scope, counting, send)


class ClosingGate:
    """503 for API requests once the backend began shutting down, and for a request whose task shutdown
    cancelled before it answered (uvicorn's graceful timeout ran out while it was tokenized, queued or
    waiting for its save): uvicorn itself would answer a bare 500."""

    def __init__(self, app: ASGIApp, closing: Callable[[], bool]):
        self.app, self.closing = app, closing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if path.startswith("/v1/") and path not in DRAIN_OPEN and self.closing():
            err = ApiError(UNAVAILABLE, "the server is shutting down", code="shutting_down")
            return await error_response(path, err)(scope, receive, send)
        watched = Watched(send)
        try:
            await self.app(scope, receive, watched)
        except asyncio.CancelledError:
            if watched.started or not self.closing():
                raise
            # the task was cancelled to end it: it ends here, answered
            err = ApiError(UNAVAILABLE, "the server is shutting down and its --graceful-timeout ran out before "
                                        "this request was answered; retry it once the server is back",
                           code="shutting_down")
            await error_response(path, err)(scope, receive, send)


class Leases:
    """Each request's model leases (``semantic.serve.fleet.fleet.Lease``), released once its answer is sent, a
    stream's last byte included: until then its model is not unloaded."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held: list = []
        scope.setdefault("state", {})["leases"] = held
        try:
            await self.app(scope, receive, send)
        finally:
            for lease in held:
                lease.release()
            held.clear()
