"""A client-side load generator for any OpenAI-compatible chat endpoint.

The workload has the shape of LMCache's multi-round QA and vLLM's multi-turn
serving benchmark: N users share a system prompt, each user's history grows
round by round, and every answer is streamed back greedily. Everything is
timed from the client (the only clock that sees every server alike):

    send ──► first content chunk ──► … chunks … ──► [DONE]
         ttft                  inter-token gaps
         └──────────────────── e2e ───────────────┘

Token counts come from the model's own tokenizer, the same for every server;
the cached tokens a server reports (where it reports them) are kept beside.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it."""

    server: str
    phase: str
    user: int
    round: int
    kind: str                       # "first", "append", "regenerate", "edit"
    prompt_tokens: int              # counted with the model's tokenizer (chat template applied)
    started_at: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    reply: str = ""
    cached_tokens: int | None = None  # as the server reported it in usage (None: it does not)
    completion_tokens: int | None = None  # generated, as the server reported it in usage (None: it does not)
    error: str | None = None

    def row(self) -> dict:
        d = asdict(self)
        d["itl_p50_s"] = _pct(self.itl_s, 50)
        d["itl_p99_s"] = _pct(self.itl_s, 99)
        del d["itl_s"], d["reply"]
        return d


def _pct(xs: Sequence[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(xs, q)) if xs else None


async def chat(client, server: str, phase: str, user: int, round_: int, kind: str, model: str,
               messages: list[dict], max_tokens: int, count: Callable[[list[dict]], int],
               extra: dict | None = None, timeout: float = 600.0) -> RequestRecord:
    """Send one streamed chat request and record what the client saw; errors are recorded, not raised."""
    rec = RequestRecord(server, phase, user, round_, kind, count(messages), time.time())
    t0 = time.perf_counter()
    last = None
    parts: list[str] = []
    try:
        stream = await asyncio.wait_for(client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra or None), timeout)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].delta.content:
                if rec.ttft_s is None:
                    rec.ttft_s = now - t0
                elif last is not None:
                    rec.itl_s.append(now - last)
                last = now
                parts.append(chunk.choices[0].delta.content)
            usage = getattr(chunk, "usage", None)
            if usage is not None:
                details = getattr(usage, "prompt_tokens_details", None)
                cached = getattr(details, "cached_tokens", None) if details is not None else None
                rec.cached_tokens = int(cached) if cached is not None else None
                done = getattr(usage, "completion_tokens", None)
                rec.completion_tokens = int(done) if done is not None else None
        rec.e2e_s = time.perf_counter() - t0
        if rec.ttft_s is None:  # an empty reply: the first token was the end
            rec.ttft_s = rec.e2e_s
    except Exception as exc:  # a peer's failure is a result, not a crash of the run
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    rec.reply = "".join(parts)
    return rec


def generated(rec: RequestRecord) -> int:
    """The tokens a turn generated: as its server reported them, else its reply's text counted again (which
    may tokenize otherwise than it was generated)."""
    return rec.completion_tokens if rec.completion_tokens is not None else rec.output_tokens


def chat_counter(tokenizer) -> Callable[[list[dict]], int]:
    """Prompt tokens of a message list under the model's chat template (what every server prefills)."""

    def count(messages: list[dict]) -> int:
        return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))

    return count
