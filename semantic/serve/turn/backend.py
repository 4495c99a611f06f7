"""The one object the HTTP layer talks to: the service's worker thread bridged to asyncio, text out.

The routes (``semantic.serve.openai``, ``anthropic``, ``responses``) turn an API's JSON into an
:class:`ApiRequest` and a stream of :class:`Delta` / :class:`Final` back into that API's JSON; the
:class:`Service` (``semantic.service``) does the rest, and this module is the only one of the HTTP
layer that calls it::

    route ─► ApiRequest ─► Backend.prepare ─► Prepared (the turn's Request: tokenized off the loop)
                                      │ raises InvalidRequestError / ContextLengthError (400)
          ◄── Delta … Final ◄── Backend.stream ◄── Service (the scheduler's worker thread)
                                      │ raises QueueFullError (429), SchedulerClosedError (503)
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from pathlib import Path

from semantic.service import FAILED, PENDING, SchedulerClosedError, Service
from semantic.serve.stream.items import Final
from semantic.serve.turn.apirequest import ApiRequest, Prepared
from semantic.serve.stream.text import TextStream
from semantic.serve.stream.thinking import ThinkSplitter, opens_in_reasoning
from semantic.serve.stream.toolcalls import CallSplitter

log = logging.getLogger(__name__)

_DONE = object()
SYNC_SAVE_WAIT_S = 120.0  # a reply waits this long for its save at most (then it says "pending")


class _Relay:
    """One turn's way from the worker thread to its stream: text deltas through an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.text: TextStream | None = None  # set once the request is prepared, before it is submitted
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cached: int | None = None  # set at admission, before the first token

    def post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is gone (shutdown): nobody is listening

    def on_token(self, token: int, logprob: float, row) -> bool:
        delta = self.text.feed(token, logprob, row)
        if delta is not None:
            self.post(delta)
        return self.text.stopped

    def on_admit(self, cached: int) -> None:
        self.cached = cached


class Backend:
    """A :class:`Service` for the HTTP routes: ``prepare``, ``stream``, ``stats``, shutdown.

    Args:
        service: the model, its caches and its scheduler.
        model_id: the name clients use.
        sync_saves: a named agent's Final waits until its cache file is written, and says whether it
            was ("saved" / "failed"); without it, a Final says "pending" (saved behind the reply).
    """

    def __init__(self, service: Service, *, model_id: str, sync_saves: bool = False):
        self.service, self.model_id, self.sync_saves = service, model_id, sync_saves
        # what a request can use: the model's context, or less when the pool holds no longer cache
        self.context_length = min(service.context_length, service.pool_tokens)
        self.responses_dir = Path(service.store.dir) / "responses"  # stored responses, beside the agents' caches
        self.closing = False
        self.started = time.time()
        self._lock = threading.Lock()  # _recent and _generated: the event loop writes, stats() reads on a thread
        self._recent: deque[dict] = deque(maxlen=64)
        self._generated = 0

    def model_info(self) -> tuple[list[str], bool]:
        """The model's layer kinds (global, sliding, recurrent) and whether greedy turns may draft."""
        return sorted({l.kind for l in self.service.store.spec.layers}), self.service.speculating

    @classmethod
    def from_model(cls, model: str, *, model_id: str | None = None, sync_saves: bool = False, **opening) -> "Backend":
        """Open ``model`` (``Service.open`` with ``opening``: cache_dir, the budgets, the scheduler's knobs)."""
        service = Service.open(model, **opening)
        name = model_id or (service.model_path.name if Path(model).expanduser().is_dir() else model)
        log.info("serving %s as %r", service.model_path, name)
        return cls(service, model_id=name, sync_saves=sync_saves)

    # ------------------------------------------------------------ requests

    async def prepare(self, req: ApiRequest) -> Prepared:
        """Tokenize and check ``req`` off the event loop; nothing is queued. Raises InvalidRequestError (400)."""
        relay = _Relay(asyncio.get_running_loop())
        turn = await asyncio.to_thread(self.service.prepare, req, on_token=relay.on_token, on_admit=relay.on_admit)
        reading = turn.tools
        splitter = CallSplitter(reading, "toolu_" if req.api.startswith("anthropic") else "call_") \
            if reading is not None and reading.reads_calls else None
        quiet = (reading.format.start,) if reading is not None and reading.stop_at_call else ()
        relay.text = TextStream(self.service.tokenizer, req.stop, req.logprobs,
                                req.sampling.top_logprobs if req.logprobs else 0, self.service.eos, splitter, quiet,
                                self._thinker(req, turn.prompt_text))
        return Prepared(req, turn, relay, self)

    def _thinker(self, req: ApiRequest, prompt_text: str | None) -> ThinkSplitter | None:
        """A chat reply of a model with think markers is split into reasoning and content."""
        tok = self.service.tokenizer
        if req.messages is None or not getattr(tok, "has_thinking", False):
            return None
        start, end = tok.think_start, tok.think_end
        return ThinkSplitter(start, end, opens_in_reasoning(prompt_text, start, end))

    def echo_state(self, tenant: str, agent: str | None) -> dict | None:
        """The agent's last turn as generated, for a stored response (``Service.echo_state``)."""
        return self.service.echo_state(tenant, agent) if agent is not None else None

    def knows_agent(self, tenant: str, agent: str) -> bool:
        return self.service.knows_agent(tenant, agent)

    def restore_echo(self, tenant: str, agent: str, state: dict) -> None:
        self.service.restore_echo(tenant, agent, state)

    async def stream(self, prepared: Prepared):
        """The turn's deltas, then its :class:`Final`. Closing this generator early cancels the turn."""
        if self.closing:
            raise SchedulerClosedError("the server is shutting down")
        turn, relay = prepared.turn.request, prepared.relay
        future = self.service.submit(turn)
        # the answer ends when the last token is read; the cache is kept after it (the agent's next turn waits)
        tokens = future.tokens
        tokens.add_done_callback(lambda _: relay.post(_DONE))
        first = True
        try:
            while (item := await relay.queue.get()) is not _DONE:
                if isinstance(item, BaseException):  # aborted (shutdown ran out of time): the finally cancels
                    raise item
                if first:  # admission ran on the worker before any token: the cache hit is known
                    item.cached_tokens, first = relay.cached, False
                yield item
            result = tokens.result()
            saved = await self._saved(turn, future) if turn.persist else None
            tail = relay.text.finish()
            if tail is not None:
                yield tail
            # a named agent's Final writes its echo beside its cache file (``Service.remember``): off the loop
            yield await asyncio.to_thread(self._final, prepared, result, relay.text, saved) if turn.persist \
                else self._final(prepared, result, relay.text, saved)
        finally:
            if not tokens.done():
                self.service.cancel(future)

    @staticmethod
    def abort(prepared: Prepared, exc: BaseException) -> None:
        """End the turn's stream with ``exc`` (raised where it is read), queued or running; its turn is cancelled."""
        prepared.relay.post(exc)

    async def _saved(self, turn, future) -> str:
        """What became of a named agent's save: with ``sync_saves``, waited for ("saved" or "failed");
        else "pending" (written behind the reply), unless it is already known."""
        if not self.sync_saves:
            return self.service.save_outcome(future.result()) if future.done() and not future.exception() \
                else PENDING
        try:
            completion = await asyncio.wrap_future(future)
        except Exception:  # the step failed after the last token was read: nothing was kept
            return FAILED
        if completion.save_number:
            await asyncio.to_thread(self.service.wait_saved, turn.agent_id, SYNC_SAVE_WAIT_S)
        return self.service.save_outcome(completion)

    def _final(self, prepared: Prepared, result, text: TextStream, saved: str | None) -> Final:
        final = Final(result, text.content, text.stop_sequence, tuple(text.calls), text.reasoning,
                      text.reasoning_tokens, saved)
        self.service.remember(prepared.turn, result, final.text, final.tool_calls, final.stop_sequence)
        with self._lock:
            self._generated += final.completion_tokens
            self._recent.append({
                "at": time.time(), "ttft_s": final.ttft_s, "prompt_tokens": final.prompt_tokens,
                "cached_tokens": final.cached_tokens, "completion_tokens": final.completion_tokens,
                "api": prepared.api.api or ("chat" if prepared.api.messages is not None else "completions"),
            })
        return final

    # ------------------------------------------------------------ state

    def stats(self, tenant: str | None = None) -> dict:
        """Counters and what the caches hold now (agents of ``tenant`` only, when given)."""
        st = self.service.stats()
        s, store, pool = st.scheduler, st.store, st.pool
        now = time.time()
        agents = [{
            "agent": a.agent_id.split("/", 1)[1] if "/" in a.agent_id else a.agent_id,
            "cached_tokens": a.cached_tokens, "age_s": round(now - a.last_used, 1) if a.last_used else None,
            "where": "ram" if a.resident else "disk",
        } for a in self.service.agents(tenant)]
        with self._lock:
            recent, generated = list(self._recent), self._generated
        return {
            "model": self.model_id,
            "uptime_s": round(now - self.started, 1),
            "requests": {"submitted": s.submitted, "completed": s.completed, "failed": s.failed, "rejected": s.rejected,
                         "cancelled": s.cancelled, "queued": s.queued, "in_flight": s.in_flight},
            "tokens": {"prompt": s.prompt_tokens, "cached": s.cached_tokens, "generated": generated,
                       "hit_rate": round(s.token_hit_rate, 4)},
            "pool": {"total_blocks": pool.total, "used_blocks": pool.used, "cached_blocks": pool.cached,
                     "block_tokens": st.block_tokens, "used_bytes": pool.used_bytes,
                     "capacity_bytes": st.pool_capacity_bytes, "longest_cache_tokens": self.service.pool_tokens,
                     # how the budgets were derived from the machine (null: the flags gave them)
                     "sizing": _sizing(self.service.budgets)},
            # resident caches: distinct pool blocks counted once, sampled after every scheduler pass for the peak
            "ram": {"agents": s.resident_agents, "bytes": s.resident_bytes, "budget_bytes": s.ram_budget_bytes,
                    "peak_bytes": s.resident_peak_bytes, "budget_evictions": s.budget_evictions,
                    "budget_waits": s.budget_waits, "over_budget_steps": s.over_budget_steps,
                    "over_budget_reason": s.over_budget_reason},
            # state: "ok", or why saves fail now ("disk_full", "read_only", "missing", "io"): caches stay in RAM
            # layout "blocks": block files written once and shared (shared_bytes: used by two agents or more)
            "disk": {"agents": store.disk_agents, "bytes": store.disk_bytes, "budget_bytes": st.disk_budget_bytes,
                     "dir": st.cache_dir, "layout": store.layout, "shared_bytes": store.disk_shared_bytes,
                     "unique_bytes": store.disk_unique_bytes, "block_files": store.disk_block_files,
                     "written_bytes": store.written_bytes, "collected_files": store.collected,
                     "newer_format_files": store.newer, **_disk_state(store.disk)},
            # lost: caches dropped from RAM unsaved (their saves failed) to hold the memory bounds
            "saves": {"done": s.saves, "errors": s.save_errors, "pending": s.pending_saves,
                      "skipped": (store.disk or {}).get("skipped", 0), "lost": s.lost_caches,
                      "prefixes": s.prefix_saves,  # a sliding window's prefixes kept on disk apart from agents
                      "errors_by_kind": (store.disk or {}).get("errors_by_kind", {})},
            # an agent's echoed reply: its generated ids, or rendered again (an edit, a restart, another client)
            "echo": {"spliced": st.echo_spliced, "rendered": st.echo_rendered},
            # prompt-lookup drafts: each accepted token is one decode step saved
            # off_reason: why this model never drafts (chunked layers; recurrent code that ignores row lengths)
            # replays: passes that put recurrent layers back after a refused draft (semantic.decode.replay)
            "speculation": {"steps": st.spec_steps, "drafted": st.spec_drafted, "accepted": st.spec_accepted,
                            "replays": st.spec_replays, "off_reason": st.spec_off},
            "cache_kinds": list(st.cache_kinds),
            # groups: whether a turn writes into the pool's own buffers (true) or a copy of its cache (false:
            # quantized, sliding, recurrent); lent_turns / copied_turns: resumed turns each way (a copied one
            # was charged its copy at admission); grown_segments, joined_histories: buffers grown or joined for them
            "in_place": st.in_place,
            # off_reason: why this model decodes one sequence at a time (its code or its caches do not batch);
            # rows_apart: whether agents decoding together keep their global layers' rows in their own buffers
            # (no merged copy), else merge_reason says why they merge
            "batch": {"off_reason": st.batch_off, "rows_apart": st.rows_off is None, "merge_reason": st.rows_off},
            # the tier shared with other servers (--remote): hits, misses, bytes, verification failures, latency
            "remote": st.remote,
            "evictions": s.evictions + store.disk_evictions,
            "quarantined": store.quarantined,
            # the newest files refused as damaged (moved: False when the directory could not be written);
            # file names carry agent ids, so a tenant's view leaves them out
            "quarantined_recent": [] if tenant else [
                {"file": Path(q.original).name, "moved": q.moved, "reason": q.reason}
                for q in self.service.store.quarantined[-16:]],
            "agents": agents,
            "recent": recent,
        }

    def holders(self) -> list:
        """What holds this model's memory: its weights (the model) and its KV pool. An unload waits for both
        to be collected (``semantic.serve.fleet.memory.release``)."""
        return [self.service.scheduler.executor.model, self.service.store.pool]

    def begin_shutdown(self) -> None:
        """Stop admitting: new requests get 503 from now on."""
        self.closing = True

    async def aclose(self, timeout: float = 30.0) -> None:
        """Finish what is queued and in flight, write pending saves, stop the threads."""
        self.closing = True
        await asyncio.to_thread(self.service.close, timeout)


def _sizing(b) -> dict | None:
    if b is None:
        return None
    return {"memory_bytes": b.machine.memory, "memory_source": b.machine.source, "reserve_bytes": b.reserve,
            "fixed_bytes": b.fixed, "working_bytes": b.working, "models": b.models, "typical_agents": b.agents,
            "summary": b.describe()}


def _disk_state(disk: dict | None) -> dict:
    """The store's directory state for the stats: ``DiskHealth.snapshot`` less the counts shown under saves."""
    if disk is None:
        return {}
    keep = ("state", "reason", "state_s", "retry_in_s", "free_bytes", "room_bytes", "effective_budget_bytes")
    return {k: disk[k] for k in keep if k in disk}
