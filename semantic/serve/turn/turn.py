"""One turn through the backend, the same for every API: run, relay, count.

The routes build a :class:`ApiRequest` and await ``backend.prepare``
(tokenized off the event loop, its output budget fitted); a :class:`Turn`
pulls :class:`Delta` / :class:`Final` items from the backend, times the gaps
between deltas and counts the final usage, and is always closed, so a turn
nobody reads any more is cancelled.
"""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request

from semantic.serve.stream.items import Delta, Final, TokenLogprob
from semantic.serve.turn.apirequest import Prepared
from semantic.serve.errors import NOT_FOUND, UNAVAILABLE, ApiError
from semantic.serve.fleet.fleet import ModelLoadError, ModelMemoryError, ModelNotFoundError, Slot
from semantic.serve.state import ServeState
from semantic.serve.stream.sse import until_disconnect

CLAMP_HEADER = "X-Max-Tokens-Clamped"  # a max_tokens the context could not hold was cut to this
SAVE_HEADER = "X-Semantic-Cache-Save"   # a named agent's cache: saved, pending (behind the reply) or failed


def resolve_model(state: ServeState, model: str | None) -> Slot:
    """The served model ``model`` names (an id or an alias; None: the default): resolved once, first, so a
    request for a model nothing serves is a 404 before any other check.

    Raises:
        ApiError: 404 for a name no served model or alias matches (listing what is).
    """
    try:
        return state.models.slot(model)
    except ModelNotFoundError as exc:
        raise ApiError(NOT_FOUND, str(exc), param="model", code="model_not_found") from None


async def use_model(state: ServeState, request: Request, slot: Slot):
    """The backend of ``slot``'s model (from :func:`resolve_model`), loaded first when it is not; held for
    this request until its answer is sent (``gates.Leases``).

    Raises:
        ApiError: 503 for a model that cannot load or fit.
    """
    try:
        lease = await state.models.acquire(slot)
    except ModelLoadError as exc:
        raise ApiError(UNAVAILABLE, str(exc), param="model", code="model_load_failed") from None
    except ModelMemoryError as exc:
        raise ApiError(UNAVAILABLE, str(exc), param="model", code="insufficient_memory") from None
    held = getattr(request.state, "leases", None)
    if held is None:  # no Leases middleware (an app built without it): nothing would release it
        lease.release()
    else:
        held.append(lease)
    return lease.backend


def salt_of(request: Request, body_salt: str | None = None) -> str | None:
    """The cache salt: the body's ``cache_salt`` (OpenAI's APIs), else the ``X-Cache-Salt`` header (any API)."""
    return body_salt if body_salt is not None else request.headers.get("x-cache-salt")


def agent_of(request: Request, *names: str | None) -> str | None:
    """The first agent id given: the body's fields in order, then the ``X-Agent-Id`` header."""
    for name in (*names, request.headers.get("x-agent-id")):
        if name is not None:
            return name
    return None


class Turn:
    """The backend's stream for one request, relayed to one client and always closed."""

    def __init__(self, state: ServeState, prepared: Prepared, api: str):
        self.prepared, self.api, self.metrics = prepared, api, state.metrics
        self._backend = prepared.backend or state.backend
        self.stream = self._backend.stream(prepared)
        self._open = state.turns
        self._open.add(self)
        self._first: Delta | Final | None = None
        self._last_delta: float | None = None
        self.final: Final | None = None

    @property
    def headers(self) -> dict[str, str]:
        """The response's own headers: ``X-Max-Tokens-Clamped`` (the budget used) when ``max_tokens`` was cut;
        once the turn has ended (a response that is not streamed), ``X-Semantic-Cache-Save`` for a named agent."""
        out = {}
        clamped = self.prepared.clamped_max_tokens
        if clamped is not None:
            out[CLAMP_HEADER] = str(clamped)
        if self.final is not None and self.final.cache_save is not None:
            out[SAVE_HEADER] = self.final.cache_save
        return out

    @property
    def prompt_tokens(self) -> int:
        return len(self.prepared.ids)

    @property
    def opens_with_calls(self) -> bool:
        """Whether the reply's first item (once :meth:`open` has it) is a tool call and no text."""
        first = self._first
        return isinstance(first, Delta) and bool(first.tool_calls) and not first.text

    @property
    def opens_with_reasoning(self) -> bool:
        """Whether the reply's first item (once :meth:`open` has it) is a thinking model's reasoning."""
        first = self._first
        return isinstance(first, Delta) and bool(first.reasoning)

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens a cache covered, once :meth:`open` has the first item (None before)."""
        first = self._first
        if isinstance(first, Final):
            return first.cached_tokens
        return first.cached_tokens if first is not None else None

    async def open(self, request: Request) -> None:
        """Wait for the first item, so a refusal (queue full, closing) is still an HTTP status.

        Raises:
            QueueFullError, SchedulerClosedError: from the backend (429, 503).
            ClientGone: the client left while the turn waited (the turn is cancelled).
        """
        try:
            self._first = await until_disconnect(request.receive, self._pull())
        except BaseException:
            await self.close()
            raise

    async def next(self) -> Delta | Final:
        if self._first is not None:
            item, self._first = self._first, None
            return item
        return await self._pull()

    async def collect(self) -> tuple[Final, list[TokenLogprob]]:
        """Read to the end: the Final and every delta's token logprobs."""
        logprobs: list[TokenLogprob] = []
        while True:
            item = await self.next()
            if isinstance(item, Final):
                return item, logprobs
            logprobs.extend(item.logprobs)

    async def run(self, request: Request) -> tuple[Final, list[TokenLogprob]]:
        """A whole non-streamed turn; cancelled if the client leaves before it ends."""
        try:
            return await until_disconnect(request.receive, self.collect())
        finally:
            await self.close()

    def abort(self, exc: BaseException) -> None:
        """End the turn at once with ``exc``: a response not yet begun answers its status (a 503 for a
        SchedulerClosedError), a stream its error event; the scheduler's turn is cancelled."""
        self._backend.abort(self.prepared, exc)

    async def close(self) -> None:
        # shielded: the backend must hear the cancel even if this task is being cancelled too
        try:
            await asyncio.shield(self.stream.aclose())
        finally:
            self._open.discard(self)

    async def _pull(self) -> Delta | Final:
        try:
            item = await anext(self.stream)
        except StopAsyncIteration:
            raise RuntimeError("the backend's stream ended without a Final") from None
        if isinstance(item, Delta):
            now = time.perf_counter()
            if self._last_delta is not None:
                self.metrics.inter_token.labels(self.api, self._backend.model_id).observe(now - self._last_delta)
            self._last_delta = now
        else:
            self.final = item
            self.metrics.observe_final(self.api, self._backend.model_id, item)
        return item
