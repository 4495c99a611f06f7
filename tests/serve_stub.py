"""A stand-in for ``semantic.serve.turn.backend.Backend`` in the HTTP-layer tests.

The HTTP layer's job is parsing, routing, error shapes and wire formats,
so its tests drive it with scripted replies instead of a model: fast and
exact. The real Backend is tested against real models separately.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass, field

from semantic.serve.stream.items import Delta, Final, TokenLogprob, TopLogprob
from semantic.serve.turn.apirequest import ApiRequest, Prepared
from semantic.service import Completion, PreparedTurn, Request, fit_max_tokens


@dataclass
class StubBackend:
    """Replies with ``pieces`` one Delta each, then a Final with the given usage."""

    model_id: str = "stub-model"
    context_length: int = 64
    closing: bool = False
    pieces: tuple[str, ...] = ("Hel", "lo", " world")
    finish_reason: str = "stop"
    stop_sequence: str | None = None
    cached_tokens: int = 3
    delay_s: float = 0.0              # before each piece: lets a test disconnect mid-stream
    refuse: Exception | None = None   # raised before the first item (QueueFullError, ...)
    fail_after: int | None = None     # raise RuntimeError after this many pieces
    calls: tuple = ()                 # ToolCalls the reply ends with, in one delta
    strict_max_tokens: bool = False   # the service's --strict-max-tokens
    evicted_agents: set = field(default_factory=set)  # agents whose caches the disk budget evicted
    responses_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="stub-responses-"))
    prepared: list[Prepared] = field(default_factory=list)
    streamed: list[Prepared] = field(default_factory=list)  # what reached stream(), after the route's changes
    finished: int = 0                 # streams that reached their Final
    closed_early: int = 0             # streams closed or cancelled before their Final
    shut: list[str] = field(default_factory=list)

    async def prepare(self, req: ApiRequest) -> Prepared:
        text = req.prompt if isinstance(req.prompt, str) else " ".join(m["content"] or "" for m in req.messages or [])
        ids = tuple(req.prompt) if isinstance(req.prompt, list) else tuple(range(len(text.split()) + 2))
        # the service's own fitting: a budget cut to the context (refused past it when strict)
        max_tokens = fit_max_tokens(len(ids), req.max_tokens, context_length=self.context_length,
                                   strict=self.strict_max_tokens, default=None if req.until_context else 256)
        turn = Request(f"{req.tenant or 'public'}/{req.agent or 'anon'}", ids, max_tokens, sampling=req.sampling,
                       persist=req.agent is not None)
        p = Prepared(api=req, turn=PreparedTurn(turn))
        self.prepared.append(p)
        return p

    async def stream(self, prepared: Prepared):
        self.streamed.append(prepared)
        if self.refuse is not None:
            raise self.refuse
        t0, done = time.perf_counter(), False
        try:
            for i, piece in enumerate(self.pieces):
                if self.fail_after is not None and i == self.fail_after:
                    raise RuntimeError("the stub broke (secret detail)")
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                lps = [TokenLogprob(piece, i, -0.5, tuple(piece.encode()),
                                    top=(TopLogprob(piece, i, -0.5, tuple(piece.encode())),))] \
                    if prepared.api.logprobs else []
                yield Delta(piece, lps)
            if self.calls:
                yield Delta("", tool_calls=list(self.calls))
            done = True
            now = time.perf_counter()
            result = Completion(
                request=prepared.turn.request, uid=0, token_ids=list(range(len(self.pieces))), logprobs=[-0.5] * len(self.pieces),
                finish_reason=self.finish_reason, cached_tokens=self.cached_tokens, reuse="own", blocks=None,
                admitted_at=t0, first_token_at=prepared.turn.request.arrived_at + 0.01, finished_at=now)
            yield Final(result, "".join(self.pieces), self.stop_sequence, tuple(self.calls))
        finally:
            if done:
                self.finished += 1
            else:
                self.closed_early += 1

    def model_info(self) -> tuple[list[str], bool]:
        return ["global"], True

    def echo_state(self, tenant: str, agent: str | None) -> dict | None:
        return None

    def restore_echo(self, tenant: str, agent: str, state: dict) -> None:
        pass

    def knows_agent(self, tenant: str, agent: str) -> bool:
        return agent not in self.evicted_agents

    def stats(self, tenant: str | None = None) -> dict:
        return {
            "model": self.model_id, "uptime_s": 1.0,
            "requests": {"submitted": 1, "completed": 1, "failed": 0, "rejected": 0, "cancelled": 0, "queued": 2,
                         "in_flight": 1},
            "tokens": {"prompt": 10, "cached": 4, "generated": 3, "hit_rate": 0.4},
            "pool": {"total_blocks": 8, "used_blocks": 2, "cached_blocks": 1, "block_tokens": 16, "used_bytes": 2048,
                     "capacity_bytes": 8192},
            "ram": {"agents": 1, "bytes": 1024, "budget_bytes": 4096, "peak_bytes": 2048, "budget_evictions": 3,
                    "budget_waits": 0, "over_budget_steps": 0, "over_budget_reason": None},
            "disk": {"agents": 1, "bytes": 512, "budget_bytes": 8192, "dir": "/tmp/x", "layout": "blocks",
                     "shared_bytes": 256, "unique_bytes": 256, "block_files": 2, "written_bytes": 1024,
                     "collected_files": 0, "newer_format_files": 0},
            "saves": {"done": 1, "errors": 0, "pending": 0},
            "echo": {"spliced": 2, "rendered": 1},
            "evictions": 5, "quarantined": 0,
            "agents": [{"agent": "a1", "cached_tokens": 32, "age_s": 1.5, "where": "ram"}],
            "recent": [{"at": 1.0, "ttft_s": 0.01, "prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 3,
                        "api": "chat"}],
            "tenant": tenant,
        }

    def begin_shutdown(self) -> None:
        self.closing = True
        self.shut.append("begin")

    async def aclose(self, timeout: float = 30.0) -> None:
        self.shut.append("aclose")
