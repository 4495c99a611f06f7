"""The one request type every API's route builds, and what the backend prepares it into.

A route turns an API's JSON into an :class:`ApiRequest`: the service's :class:`~semantic.service.TurnRequest`
(what the turn asks, in no API's terms) plus how its reply streams back (stop strings, logprobs, which
endpoint). The backend prepares it (``Service.prepare``) into a :class:`Prepared` and answers with the items
of ``semantic.serve.stream.items``. No model is needed to build either, so the HTTP layer's tests run
without one::

    route ─► ApiRequest (a TurnRequest) ─► Backend.prepare ─► Prepared(api, turn: PreparedTurn, relay)
"""

from __future__ import annotations

from dataclasses import dataclass

from semantic.service import InvalidRequestError, PreparedTurn, TurnRequest

MAX_STOP = 16          # stop strings per request (OpenAI allows 4; Anthropic more)
MAX_STOP_CHARS = 256


@dataclass(frozen=True, slots=True)
class ApiRequest(TurnRequest):
    """One API request: the turn it asks for (every :class:`TurnRequest` field) and how its reply streams."""

    stop: tuple[str, ...] = ()
    logprobs: bool = False        # report each generated token's logprob (and sampling.top_logprobs alternatives)
    api: str = ""                 # which endpoint asked (shown on the dashboard)

    def __post_init__(self):
        super(ApiRequest, self).__post_init__()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOP or any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS for s in stop):
            raise InvalidRequestError(f"stop takes at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters")
        object.__setattr__(self, "stop", stop)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked API request, ready to stream: what the client asked, and the service's turn for it."""

    api: ApiRequest
    turn: PreparedTurn            # the executor's Request (token ids, the tenant-namespaced agent id, fitted max_tokens)
    relay: object = None          # the backend's way back from the worker thread (None in stand-ins)
    backend: object = None        # the model's backend that prepared it (None in stand-ins: the default's)

    @property
    def ids(self) -> tuple[int, ...]:
        return self.turn.request.ids

    @property
    def clamped_max_tokens(self) -> int | None:
        """The budget the turn runs with when the client's ``max_tokens`` was cut to fit the context (else None)."""
        asked, ran = self.api.max_tokens, self.turn.request.max_tokens
        return ran if asked is not None and ran < asked else None
