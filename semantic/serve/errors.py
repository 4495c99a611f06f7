"""Every error the server answers with, in one place and in the caller's API's shape.

OpenAI: ``{"error": {"message", "type", "param", "code"}}``; Anthropic (the
``/v1/messages`` paths): ``{"type": "error", "error": {"type", "message"}}``.
Nothing ever answers with a traceback: :class:`CatchAll` turns whatever
escapes into a generic 500 in the same shape, and logs it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from semantic.service import errors as semantic_errors

log = logging.getLogger("semantic.serve")


@dataclass(frozen=True, slots=True)
class ErrorType:
    """One type of error: its usual status and its ``type`` in each API."""

    status: int
    openai: str
    anthropic: str


INVALID = ErrorType(400, "invalid_request_error", "invalid_request_error")
AUTH = ErrorType(401, "authentication_error", "authentication_error")
NOT_FOUND = ErrorType(404, "not_found_error", "not_found_error")
CONFLICT = ErrorType(409, "invalid_request_error", "invalid_request_error")
TOO_LARGE = ErrorType(413, "invalid_request_error", "request_too_large")
RATE_LIMIT = ErrorType(429, "rate_limit_error", "rate_limit_error")
SERVER = ErrorType(500, "server_error", "api_error")
UNAVAILABLE = ErrorType(503, "service_unavailable", "overloaded_error")


class ApiError(HTTPException):
    """An error answer. An HTTPException, so FastAPI passes it through body parsing."""

    def __init__(self, error_type: ErrorType, message: str, *, param: str | None = None, code: str | None = None,
                 status: int | None = None, headers: dict[str, str] | None = None):
        super().__init__(status or error_type.status, message, headers)
        self.type, self.message, self.param, self.code = error_type, message, param, code


def invalid(message: str, param: str | None = None) -> ApiError:
    """A 400 for a request this server cannot honour, naming the field."""
    return ApiError(INVALID, message, param=param)


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(path: str, err: ApiError) -> dict:
    if is_anthropic(path):
        return {"type": "error", "error": {"type": err.type.anthropic, "message": err.message}}
    return {"error": {"message": err.message, "type": err.type.openai, "param": err.param, "code": err.code}}


def error_response(path: str, err: ApiError) -> Response:
    # the access log shows only the status: say why, so a refused client can be understood from the server's side
    log.info("%s %d: %s", path, err.status_code, err.message[:300])
    return JSONResponse(error_body(path, err), status_code=err.status_code, headers=err.headers)


def sse_error(path: str, err: ApiError) -> bytes:
    """The error as a server-sent event, for a stream whose headers are already sent."""
    body = json.dumps(error_body(path, err))
    return f"event: error\ndata: {body}\n\n".encode() if is_anthropic(path) else f"data: {body}\n\n".encode()


def from_semantic(exc: semantic_errors.CacheError) -> ApiError:
    """The answer to an error the engine (``semantic.errors``) raised on purpose."""
    if isinstance(exc, semantic_errors.QueueFullError):
        return ApiError(RATE_LIMIT, "the server's queue is full; retry shortly", code="rate_limit_exceeded",
                        headers={"Retry-After": "1"})
    if isinstance(exc, semantic_errors.SchedulerClosedError):
        return ApiError(UNAVAILABLE, "the server is shutting down", code="shutting_down")
    if isinstance(exc, semantic_errors.TurnTooLargeError):  # no retry fits it
        return ApiError(INVALID, str(exc), code="context_length_exceeded")
    if isinstance(exc, semantic_errors.PoolExhaustedError):
        return ApiError(UNAVAILABLE, "the KV-cache pool is full; retry shortly", code="pool_exhausted",
                        headers={"Retry-After": "1"})
    if isinstance(exc, semantic_errors.AgentBusyError):
        return ApiError(CONFLICT, f"this agent already has a request in flight: {exc}", code="agent_busy")
    if isinstance(exc, (semantic_errors.InvalidRequestError, semantic_errors.InvalidAgentIdError)):
        code = "context_length_exceeded" if isinstance(exc, semantic_errors.ContextLengthError) else None
        return ApiError(INVALID, str(exc) or "invalid request", code=code)
    log.error("engine error: %r", exc)
    return ApiError(SERVER, "the server could not complete the request")


def from_stream(exc: Exception) -> ApiError:
    """The answer to an error raised mid-stream, after the 200 went out."""
    if isinstance(exc, semantic_errors.CacheError):
        return from_semantic(exc)
    log.exception("error while streaming")
    return ApiError(SERVER, "the server could not complete the request")


def from_http(exc: HTTPException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    type_ = {401: AUTH, 404: NOT_FOUND, 413: TOO_LARGE, 429: RATE_LIMIT, 503: UNAVAILABLE}.get(exc.status_code)
    type_ = type_ or (SERVER if exc.status_code >= 500 else INVALID)
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    return ApiError(type_, message, status=exc.status_code, headers=exc.headers)


def from_validation(exc: RequestValidationError) -> ApiError:
    """A 400 naming the first few fields that failed (FastAPI would answer 422)."""
    parts, param = [], None
    for e in exc.errors()[:3]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            return ApiError(INVALID, f"the body is not valid JSON: {e.get('ctx', {}).get('error', 'decode error')}",
                            code="invalid_json")
        where = ".".join(loc)
        param = param or where or None
        if e.get("type") == "extra_forbidden":  # the hosted APIs refuse an unknown field too
            parts.append(f"{where}: this server does not know this field (docs/serving.md lists every field and "
                         f"what the server does with it); drop it")
            continue
        parts.append(f"{where or 'body'}: {e.get('msg', 'invalid')}")
    return ApiError(INVALID, "; ".join(parts) or "invalid request", param=param)


def install(app: FastAPI) -> None:
    """Route every known error class to one answer in the caller's API's shape."""

    async def on_http(request: Request, exc: HTTPException) -> Response:
        return error_response(request.url.path, from_http(exc))

    async def on_validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(request.url.path, from_validation(exc))

    async def on_semantic(request: Request, exc: semantic_errors.CacheError) -> Response:
        return error_response(request.url.path, from_semantic(exc))

    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(semantic_errors.CacheError, on_semantic)


class ClientGone(Exception):
    """The client disconnected before its answer was sent; nothing is left to answer."""


class Watched:
    """An ASGI ``send`` that remembers whether the response began: a middleware may still answer until then."""

    def __init__(self, send: Send):
        self.send, self.started = send, False

    async def __call__(self, message: Message) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)


class CatchAll:
    """ASGI middleware: whatever escapes the app is logged and answered with a generic 500."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        watched = Watched(send)
        try:
            await self.app(scope, receive, watched)
        except ClientGone:
            return
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not watched.started:  # else the stream already said 200; the connection just ends
                err = ApiError(SERVER, "internal server error")
                await error_response(scope.get("path", ""), err)(scope, receive, send)
