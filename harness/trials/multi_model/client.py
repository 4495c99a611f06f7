"""One streamed greedy chat turn through the ``openai`` SDK, timed at the client; a failed request is a row
with its error, never an exception (a phase goes on and the error is counted)."""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass

import openai


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
    """Send ``messages`` as agent ``agent`` (``X-Agent-Id``: ours saves its cache under that name), or under a
    fresh cache salt (``fresh``: nothing cached can match, a fresh prefill), streamed with usage at the end."""
    headers = {**({"X-Agent-Id": agent} if agent else {}), **({"X-Cache-Salt": uuid.uuid4().hex} if fresh else {})}
    t0 = time.perf_counter()
    turn = Turn()
    try:
        stream = cl.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_headers=headers)
        usage = None
        try:
            for chunk in stream:
                turn.model = turn.model or chunk.model
                usage = chunk.usage or usage
                for ch in chunk.choices:
                    if ch.delta.content and turn.ttft_s is None:
                        turn.ttft_s = time.perf_counter() - t0
                    turn.text += ch.delta.content or ""
        finally:
            stream.close()
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
