"""One streamed greedy chat turn through the ``openai`` SDK, timed at the client."""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass

import openai


@dataclass(slots=True)
class Turn:
    """A reply and what its usage said: prompt, cached and completion tokens; client TTFT (the first
    content chunk) and the whole turn's time, from the request's send to the stream's end."""

    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    total_s: float
    cache_save: str | None = None   # usage.cache_save: "saved" under --sync-saves, else "pending" / absent

    def row(self, **extra) -> dict:
        return {**asdict(self), **extra}


def client(url: str, timeout_s: float) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout_s)


def stream_turn(cl: openai.OpenAI, model: str, messages: list[dict], max_tokens: int, agent: str | None = None,
                fresh: bool = False) -> Turn:
    """Send ``messages`` as agent ``agent`` (``X-Agent-Id``; none: anonymous), or under a fresh cache salt
    (``fresh``: nothing cached can be reused), streamed with usage in the last chunk."""
    headers = {**({"X-Agent-Id": agent} if agent else {}), **({"X-Cache-Salt": uuid.uuid4().hex} if fresh else {})}
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    stream = cl.chat.completions.create(**body, stream=True, stream_options={"include_usage": True},
                                        extra_headers=headers)
    text, usage, ttft = "", None, None
    try:
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                if ch.delta.content and ttft is None:
                    ttft = time.perf_counter() - t0
                text += ch.delta.content or ""
    finally:
        stream.close()
    total = time.perf_counter() - t0
    if usage is None:
        raise RuntimeError(f"the stream for agent {agent!r} ended without usage")
    details = usage.prompt_tokens_details
    return Turn(text, usage.prompt_tokens, (details.cached_tokens or 0) if details else 0, usage.completion_tokens,
                ttft if ttft is not None else total, total, (usage.model_extra or {}).get("cache_save"))
