"""Server-sent events, and noticing a client that left so its turn is cancelled.

A turn that nobody reads any more must stop generating: the backend cancels
a turn when its stream generator is closed or its task cancelled. Starlette's
``StreamingResponse`` notices a disconnect only on some ASGI versions and
never closes its iterator; :class:`EventStream` always does both.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncGenerator, Awaitable, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from semantic.serve.errors import ClientGone

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def data(payload: dict) -> bytes:
    """One OpenAI-style event: ``data: {json}``."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def event(name: str, payload: dict) -> bytes:
    """One Anthropic-style typed event: ``event: NAME`` then ``data: {json}``."""
    return f"event: {name}\ndata: ".encode() + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _disconnected(receive: Receive) -> None:
    """Returns when the client disconnects (the request body was already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise :class:`ClientGone`."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()  # cancels the turn: the backend's generator sees CancelledError
            await asyncio.gather(task, return_exceptions=True)
        await asyncio.gather(gone, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response whose generator is always closed.

    Sends until the generator ends or the client disconnects, whichever
    comes first, then ``aclose()``\\ s the generator, so its ``finally``
    (which closes the backend's stream) runs now, not at garbage collection.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None):
        super().__init__(events, headers={**SSE_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((pump, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, gone):
                task.cancel()
            await asyncio.gather(pump, gone, return_exceptions=True)
            await self.body_iterator.aclose()
        if not pump.cancelled() and pump.exception() is not None and not isinstance(pump.exception(), OSError):
            raise pump.exception()  # OSError: the client went away mid-send
