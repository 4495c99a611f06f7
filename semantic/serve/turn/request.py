"""The one request type every API's route builds, and what the backend prepares it into.

The routes build a :class:`GenerateRequest` from an API's JSON; the backend
prepares it into the engine's :class:`~semantic.request.Request` (a
:class:`Prepared`) and answers with the items of ``semantic.serve.stream.items``.
No model is needed to build either, so the HTTP layer's tests run without one.
"""

from __future__ import annotations

from dataclasses import dataclass

from semantic.service import (
    GREEDY, InvalidRequestError, Request, SamplingParams, Tools, TurnPlan,
)

MAX_STOP = 16          # stop strings per request (OpenAI allows 4; Anthropic more)
MAX_STOP_CHARS = 256


@dataclass(slots=True)
class GenerateRequest:
    """One API request, as the backend needs it.

    Exactly one of ``messages`` (chat: ``{"role", "content"}`` string dicts,
    rendered with the model's chat template; roles system, user, assistant)
    and ``prompt`` (completions: text, or token ids) is set.
    """

    max_tokens: int | None        # None: the client named none (the server's default, fitted to the context)
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    sampling: SamplingParams = GREEDY
    stop: tuple[str, ...] = ()
    logprobs: bool = False        # report each generated token's logprob (and sampling.top_logprobs alternatives)
    tenant: str = ""              # the caller's tenant (from its API key); "" without keys
    agent: str | None = None      # prompt_cache_key / user / X-Agent-Id / metadata.user_id
    cache_salt: str | None = None
    api: str = ""                 # which endpoint asked (shown on the dashboard)
    tools: Tools | None = None    # the tools the model may call, and how (``conversation``)
    response_schema: dict | None = None  # the reply must be one JSON value matching it
    until_context: bool = False   # no max_tokens means all the context leaves (Responses), not the server's default

    def __post_init__(self):
        if (self.messages is None) == (self.prompt is None):
            raise InvalidRequestError("give exactly one of messages and prompt")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        if len(self.stop) > MAX_STOP or any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            raise InvalidRequestError(f"stop takes at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters")
        if self.agent is not None and (not isinstance(self.agent, str) or not self.agent):
            raise InvalidRequestError("the agent id (prompt_cache_key, user, X-Agent-Id, metadata.user_id) must be a non-empty string")


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked request: what the client asked and the engine's Request for it."""

    request: GenerateRequest
    turn: Request                 # token ids, the tenant-namespaced (or anonymous) agent id, the fitted max_tokens
    relay: object = None          # the backend's way back from the engine's thread (None in stand-ins)
    plan: TurnPlan | None = None  # how the reply is read, and the prompt's text for the next echo
    backend: object = None        # the model's backend that prepared it (None in stand-ins: the default's)

    @property
    def ids(self) -> tuple[int, ...]:
        return self.turn.ids

    @property
    def clamped_max_tokens(self) -> int | None:
        """The budget the turn runs with when the client's ``max_tokens`` was cut to fit the context (else None)."""
        asked = self.request.max_tokens
        return self.turn.max_tokens if asked is not None and self.turn.max_tokens < asked else None
