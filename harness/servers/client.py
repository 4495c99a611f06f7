"""One streamed greedy chat turn through the ``openai`` SDK, timed at the client."""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass
from types import SimpleNamespace

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


def stream(cl: openai.OpenAI, model: str, messages: list[dict], max_tokens: int, agent: str | None, fresh: bool,
           t0: float, got):
    """Send ``messages`` as agent ``agent`` (``X-Agent-Id``: ours saves its cache under that name; none:
    anonymous), or under a fresh cache salt (``fresh``: nothing cached can be reused), streamed with usage in
    the last chunk. What arrives is kept in ``got`` as it comes (``text``, the ``model`` the chunks name,
    ``ttft_s`` from ``t0``), so a stream that breaks leaves its part there. Returns the usage (None: none came)."""
    headers = {**({"X-Agent-Id": agent} if agent else {}), **({"X-Cache-Salt": uuid.uuid4().hex} if fresh else {})}
    chunks = cl.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                        stream=True, stream_options={"include_usage": True}, extra_headers=headers)
    usage = None
    try:
        for chunk in chunks:
            got.model = got.model or chunk.model
            usage = chunk.usage or usage
            for ch in chunk.choices:
                if ch.delta.content and got.ttft_s is None:
                    got.ttft_s = time.perf_counter() - t0
                got.text += ch.delta.content or ""
    finally:
        chunks.close()
    return usage


def stream_turn(cl: openai.OpenAI, model: str, messages: list[dict], max_tokens: int, agent: str | None = None,
                fresh: bool = False) -> Turn:
    """One turn through :func:`stream`; a stream that ends without usage raises."""
    t0, got = time.perf_counter(), SimpleNamespace(text="", model=None, ttft_s=None)
    usage = stream(cl, model, messages, max_tokens, agent, fresh, t0, got)
    total = time.perf_counter() - t0
    if usage is None:
        raise RuntimeError(f"the stream for agent {agent!r} ended without usage")
    details = usage.prompt_tokens_details
    return Turn(got.text, usage.prompt_tokens, (details.cached_tokens or 0) if details else 0, usage.completion_tokens,
                got.ttft_s if got.ttft_s is not None else total, total, (usage.model_extra or {}).get("cache_save"))
