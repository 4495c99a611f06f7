"""What the routes and the backend exchange: one request in, text deltas and a final usage out.

The routes build a :class:`GenerateRequest` from an API's JSON; the backend
prepares it into the engine's :class:`~semantic.request.Request` (a
:class:`Prepared`) and answers with :class:`Delta` items and one
:class:`Final`, which wraps the engine's :class:`~semantic.request.Completion`.
No model is needed to build any of them, so the HTTP layer's tests run without one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from semantic.service import (
    GREEDY, Completion, InvalidRequestError, Request, SamplingParams, ToolCall, Tools, TurnPlan,
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
class TopLogprob:
    token: str
    token_id: int
    logprob: float
    bytes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's text piece and logprob, and its top alternatives."""

    token: str
    token_id: int
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[TopLogprob, ...] = ()


@dataclass(slots=True)
class Delta:
    """New text since the last delta (stop strings never appear in it), and,
    when logprobs were asked for, the tokens it came from."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cached_tokens: int | None = None   # on a turn's first delta: prompt tokens a cache covered
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls completed since the last delta
    reasoning: str = ""           # a thinking model's reasoning since the last delta (never in ``text``)

@dataclass(frozen=True, slots=True)
class Final:
    """The end of a turn, always the last item of a stream: the engine's Completion and its text."""

    result: Completion
    text: str                     # the whole reply's content, cut before a stop string, its tool calls apart
    stop_sequence: str | None     # the stop string that ended it, if one did
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str = ""           # a thinking model's whole reasoning, apart from ``text``
    reasoning_tokens: int = 0     # of the generated tokens, those inside its think block
    cache_save: str | None = None  # a named agent's: "saved", "pending" or "failed" (None: anonymous)

    @property
    def finish_reason(self) -> str:
        """"tool_calls" (it called tools), "stop" (EOS or a stop string), "length", or "cancelled"."""
        if self.tool_calls and self.result.finish_reason != "cancelled":
            return "tool_calls"
        return "stop" if self.stop_sequence is not None else self.result.finish_reason

    @property
    def prompt_tokens(self) -> int:
        """The whole prompt (history), cached ones included."""
        return self.result.history_tokens

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from a cache (OpenAI cached_tokens, Anthropic cache_read_input_tokens)."""
        return self.result.cached_tokens

    @property
    def completion_tokens(self) -> int:
        """Generated tokens, the one that ended it included."""
        return len(self.result.token_ids)

    @property
    def ttft_s(self) -> float:
        """Arrival (queueing included) to the first token, server side."""
        return self.result.ttft_s

    @property
    def latency_s(self) -> float:
        return self.result.latency_s


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
