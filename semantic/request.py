"""One agent turn in and out: the :class:`Request` every floor carries as is, the :class:`Completion` it becomes.

A request is built once where it enters (the server's façade, a library
caller) and checked there, in ``Request.__post_init__``; the scheduler, the
executor and the step loop read the same object and only assert::

    prompt ──encode()──► ids ──Request(...)──► scheduler ──► executor ──► step loop
                                  │ raises InvalidRequestError / InvalidAgentIdError here, once
    Completion ◄── executor (the one result: the scheduler and the server read it, never copy it)

The one thing a request cannot know is the model's vocabulary: the executor,
which owns the model, checks the ids against it when it takes the request.
"""

from __future__ import annotations

import operator
import time
import unicodedata
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from semantic import defaults
from semantic.decode.constraint import Grammar
from semantic.errors import InvalidAgentIdError, InvalidRequestError
from semantic.decode.sampling import GREEDY, SamplingParams

if TYPE_CHECKING:
    from semantic.cache.blocks import AgentBlocks

MAX_AGENT_ID = 256

# on_token(token, logprob, logprobs row over the vocabulary) -> True to end the turn after this token;
# called on the worker thread for every generated token
OnToken = Callable[[int, float, object], bool]


def validate_agent_id(agent_id) -> None:
    """Accept the agent ids the cache store can keep (see ``store.file_name``).

    Raises:
        InvalidAgentIdError: not a string of 1 to 256 characters, or it
            contains control characters (NUL included) or lone surrogates.
    """
    if not isinstance(agent_id, str) or not 1 <= len(agent_id) <= MAX_AGENT_ID:
        shown = agent_id if not isinstance(agent_id, str) else f"{len(agent_id)} characters"
        raise InvalidAgentIdError(f"agent_id must be a string of 1 to {MAX_AGENT_ID} characters, got {shown!r}")
    if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in agent_id):
        raise InvalidAgentIdError(f"agent id {agent_id!r} contains control characters or lone surrogates")


def render_chat(tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, ready for the reply
    (:func:`render_text`, then tokenized as the template's text: special tokens by name, none added)."""
    return tokenizer.encode(render_text(tokenizer, messages, tools), add_special_tokens=False)


def render_text(tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None, *,
                generation_prompt: bool = True) -> str:
    """The chat template's text for ``messages`` (ready for the reply unless ``generation_prompt`` is False).

    A message is ``{"role", "content"}`` with string content, or an assistant
    message with ``tool_calls`` (``[{"id", "type": "function", "function":
    {"name", "arguments": {...}}}]``, arguments decoded as templates expect)
    and content that may be None. ``tools`` (OpenAI function specs) reach the
    template as its ``tools``.

    Raises:
        InvalidRequestError: not such a non-empty list, the tokenizer has no
            chat template, or the template itself refused them (a jinja
            error: the messages are at fault).
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for m in messages:
        calls = isinstance(m, dict) and m.get("tool_calls")
        content = m.get("content") if isinstance(m, dict) else None
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and (isinstance(content, str) or (calls and content is None))):
            raise InvalidRequestError(f"each message needs string 'role' and 'content', got {m!r}"[:200])
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("this tokenizer has no chat template: submit token ids or text")
    extra = {"tools": list(tools)} if tools else {}
    try:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt, tokenize=False,
                                             **extra)
    except Exception as exc:
        raise InvalidRequestError(f"the model's chat template refused these messages: {exc}"[:500]) from None


def encode(tokenizer, prompt, *, continuing: bool = False) -> Sequence[int]:
    """Token ids of ``prompt``: text (tokenized), chat messages (:func:`render_chat`), or token ids
    (as given). They are converted to a tuple of ints, and checked, once: when the :class:`Request` is built.

    ``continuing`` text follows a cached history, so it gets no second BOS in
    the middle of it.

    Raises:
        InvalidRequestError: the prompt is none of these.
    """
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=not continuing)
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        return render_chat(tokenizer, prompt)
    if isinstance(prompt, (list, tuple, range)) or hasattr(prompt, "__array__"):
        return prompt
    raise InvalidRequestError(f"prompt must be chat messages, text or token ids, got {type(prompt).__name__}")


def _token_ids(ids) -> tuple[int, ...]:
    """``ids`` as a tuple of plain ints, converted here once."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise InvalidRequestError(f"a request takes token ids; encode text or messages first, got {type(ids).__name__}")
    try:
        out = tuple(map(operator.index, ids))
        if any(isinstance(t, bool) for t in ids):
            raise TypeError("a bool is not a token id")
    except TypeError:
        raise InvalidRequestError("token ids must be integers in the vocabulary") from None
    if not out:
        raise InvalidRequestError("empty prompt: send at least one token")
    if min(out) < 0:
        raise InvalidRequestError(f"token ids must be in the vocabulary (>= 0), got {[t for t in out if t < 0][:5]}")
    return out


@dataclass(frozen=True, slots=True, eq=False)
class Request:
    """One turn of one agent, as every floor reads it (see the module doc).

    Args:
        agent_id: whose cache the turn continues and keeps.
        ids: the agent's whole history (a tuple of ints once built).
        max_tokens: the most tokens to generate.
        sampling: how tokens are picked (default greedy).
        persist: keep the agent's cache resident and save it (a named
            agent); False: an anonymous turn, whose blocks stay only in the
            pool's free queue for later hits.
        salt_root: the chain root of the tenant's block keys
            (``blockclaim.salt_root_of``); None: unsalted.
        grammar: what the generated tokens must follow (``semantic.decode.constraint``:
            a JSON schema, a tool call); None: free.
        on_token: sees each generated token (:data:`OnToken`).
        on_admit: called once when the turn starts, with the history tokens
            a cache covers. Both run on the worker thread: keep them quick.
        boundaries: positions in ``ids`` where a later turn may start over
            (message ends: the system prompt's, the last message's start);
            models that resume only from a snapshot take one there.
        arrived_at: ``time.perf_counter()`` when the request was built: its
            queueing, time to first token and latency count from here.

    Raises:
        InvalidAgentIdError, InvalidRequestError: from the checks, before
            anything else sees the request.
    """

    agent_id: str
    ids: tuple[int, ...]
    max_tokens: int = defaults.MAX_TOKENS
    sampling: SamplingParams = GREEDY
    persist: bool = True
    salt_root: int | None = None
    grammar: Grammar | None = None
    on_token: OnToken | None = field(default=None, repr=False)
    on_admit: Callable[[int], None] | None = field(default=None, repr=False)
    boundaries: tuple[int, ...] = ()
    arrived_at: float = field(default_factory=time.perf_counter, repr=False)

    def __post_init__(self):
        validate_agent_id(self.agent_id)
        object.__setattr__(self, "ids", _token_ids(self.ids))
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidRequestError(f"sampling must be SamplingParams, got {type(self.sampling).__name__}")
        if self.salt_root is not None and (isinstance(self.salt_root, bool) or not isinstance(self.salt_root, int)):
            raise InvalidRequestError(f"salt_root must be an integer (blockclaim.salt_root_of) or None, got {self.salt_root!r}")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise InvalidRequestError(f"grammar must be a semantic.decode.constraint.Grammar, got {type(self.grammar).__name__}")
        try:
            marks = tuple(sorted(set(map(operator.index, self.boundaries))))
        except TypeError:
            raise InvalidRequestError(f"boundaries must be token positions, got {self.boundaries!r}") from None
        if marks and not (0 < marks[0] and marks[-1] < len(self.ids)):
            raise InvalidRequestError(f"boundaries must lie inside the history (0, {len(self.ids)}), got {marks}")
        object.__setattr__(self, "boundaries", marks)
        for name in ("on_token", "on_admit"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be callable or None")


@dataclass(slots=True, eq=False)
class Completion:
    """A finished turn: what was generated and what its cache did.

    The executor makes it; the scheduler hands the same object to the caller
    once it has taken ``blocks`` (then None: the cache is the scheduler's,
    resident and saved); the server wraps it. Times are
    ``time.perf_counter()`` stamps; the ``_s`` properties count from the
    request's arrival, queueing included.
    """

    request: Request
    uid: int
    token_ids: list[int]        # generated, the stop token included
    logprobs: list[float]       # natural-log probability of each generated token
    finish_reason: str          # "stop", "length", or "cancelled"
    cached_tokens: int          # history tokens a cache covered
    reuse: str                  # where they came from (``reuse`` sources: own, own-cut, pool, none)
    blocks: "AgentBlocks | None"  # the finished cache (None: not kept, ``cache_error`` says why, or taken)
    cache_error: str | None = None
    admitted_at: float = 0.0    # the executor took the request
    first_token_at: float = 0.0  # the first generated token was read (materialized); 0: none
    finished_at: float = 0.0    # the sequence finished, its cache extracted
    save_number: int = 0        # the scheduler's save of its cache (``SaveState.outcome``); 0: none queued
    decode: Callable[[list[int]], str] | None = field(default=None, repr=False)  # the tokenizer's, for ``text``

    @property
    def agent_id(self) -> str:
        return self.request.agent_id

    @property
    def history_tokens(self) -> int:
        """Tokens of the history this turn was given."""
        return len(self.request.ids)

    @property
    def prompt_tokens(self) -> int:
        """History tokens prefilled for this turn (not covered by a cache)."""
        return len(self.request.ids) - self.cached_tokens

    @property
    def cache_saved(self) -> bool:
        """Whether the turn's cache was kept (False: ``cache_error`` says why)."""
        return self.cache_error is None

    @property
    def text(self) -> str:
        """The generated tokens as text, decoded when asked (the server streams its own)."""
        return self.decode(self.token_ids) if self.decode is not None else ""

    @property
    def queued_s(self) -> float:
        return max(0.0, self.admitted_at - self.request.arrived_at)

    @property
    def ttft_s(self) -> float:
        """Seconds from the request's arrival to its first generated token (0: none)."""
        return self.first_token_at - self.request.arrived_at if self.first_token_at else 0.0

    @property
    def latency_s(self) -> float:
        return self.finished_at - self.request.arrived_at

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens after the first, per second of decoding (0 for one token)."""
        dt = self.finished_at - self.first_token_at
        return (len(self.token_ids) - 1) / dt if len(self.token_ids) > 1 and dt > 0 else 0.0
