"""What the routes and the backend exchange: one request in, text deltas and a final usage out.

The routes build a :class:`GenerateRequest` from an API's JSON; the backend
answers with :class:`Delta` items and one :class:`Final`. Plain dataclasses,
so the HTTP layer and its tests need no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from semantic.errors import InvalidRequestError
from semantic.sampling import GREEDY, SamplingParams

MAX_STOP = 16          # stop strings per request (OpenAI allows 4; Anthropic more)
MAX_STOP_CHARS = 256


@dataclass(slots=True)
class GenerateRequest:
    """One API request, as the backend needs it.

    Exactly one of ``messages`` (chat: ``{"role", "content"}`` string dicts,
    rendered with the model's chat template; roles system, user, assistant)
    and ``prompt`` (completions: text, or token ids) is set.
    """

    max_tokens: int
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    sampling: SamplingParams = GREEDY
    stop: tuple[str, ...] = ()
    logprobs: bool = False        # report each generated token's logprob (and sampling.top_logprobs alternatives)
    tenant: str = ""              # the caller's tenant (from its API key); "" without keys
    agent: str | None = None      # prompt_cache_key / user / X-Agent-Id / metadata.user_id
    cache_salt: str | None = None
    api: str = ""                 # which endpoint asked (shown on the dashboard)

    def __post_init__(self):
        if (self.messages is None) == (self.prompt is None):
            raise InvalidRequestError("give exactly one of messages and prompt")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
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

@dataclass(slots=True)
class Final:
    """The end of a turn: always the last item of a stream."""

    text: str                     # the whole reply, cut before a stop string
    finish_reason: str            # "stop" (EOS or a stop string), "length", "cancelled"
    stop_sequence: str | None     # the stop string that ended it, if one did
    prompt_tokens: int            # the whole prompt (history), cached ones included
    cached_tokens: int            # of those, served from a cache (OpenAI cached_tokens, Anthropic cache_read_input_tokens)
    completion_tokens: int        # generated tokens, the one that ended it included
    ttft_s: float                 # submit (queueing included) to first token, server side
    latency_s: float
    agent: str | None             # the agent's name as the client gave it (None: anonymous)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked request: its token ids and where its cache lives."""

    request: GenerateRequest
    ids: tuple[int, ...]
    agent_id: str                 # the scheduler's id (tenant-namespaced, or an anonymous one)
    keep: bool                    # save the cache (named agents) or not (anonymous)
    salt_root: int | None              # the tenant's salt for block hashes
