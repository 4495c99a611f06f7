"""One streamed greedy chat turn (:func:`harness.servers.client.stream`), timed at the client; a failed
request is a row with its error, never an exception (a phase goes on and the error is counted)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import openai

from harness.servers.client import stream


@dataclass(slots=True)
class Turn:
    """What the client saw: the reply, the model the reply named, usage's prompt / cached / completion
    tokens, client TTFT (the first content chunk) and the whole turn, both from the request's send."""

    text: str = ""
    model: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    error: str | None = None

    def row(self, **extra) -> dict:
        return {**asdict(self), **extra}


def stream_turn(cl: openai.OpenAI, model: str, messages: list[dict], max_tokens: int, agent: str | None = None,
                fresh: bool = False) -> Turn:
    """Send ``messages`` as agent ``agent``, or under a fresh cache salt (``fresh``: a fresh prefill)."""
    t0, turn = time.perf_counter(), Turn()
    try:
        usage = stream(cl, model, messages, max_tokens, agent, fresh, t0, turn)
        turn.total_s = time.perf_counter() - t0
        if usage is None:
            raise RuntimeError("the stream ended without usage")
        details = usage.prompt_tokens_details
        turn.prompt_tokens, turn.completion_tokens = usage.prompt_tokens, usage.completion_tokens
        turn.cached_tokens = (details.cached_tokens or 0) if details else 0
        turn.ttft_s = turn.ttft_s if turn.ttft_s is not None else turn.total_s
    except Exception as exc:  # recorded: the P0 counts errors
        turn.error = f"{type(exc).__name__}: {exc}"[:600]
        turn.total_s = time.perf_counter() - t0
    return turn
