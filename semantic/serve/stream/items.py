"""What a turn's stream carries back to the routes: text deltas, then one final with the usage.

The backend answers a :class:`~semantic.serve.turn.apirequest.Prepared` with
:class:`Delta` items and one :class:`Final`, which wraps the executor's
:class:`~semantic.request.Completion`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from semantic.service import Completion, ToolCall


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
    """The end of a turn, always the last item of a stream: the executor's Completion and its text."""

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
