"""The one object the HTTP layer talks to: requests in, token deltas out.

The routes (``openai_api``, ``anthropic_api``) turn an API's JSON into a
:class:`GenerateRequest` and a stream of :class:`Delta` / :class:`Final`
back into that API's JSON; everything model- and cache-related is here::

    route ─► GenerateRequest ─► Backend.prepare ─► Prepared (ids, agent, salt)
                                      │ raises InvalidRequestError / ContextLengthError (400)
          ◄── Delta … Final ◄── Backend.stream ◄── ConcurrentScheduler (worker thread)
                                      │ raises QueueFullError (429), SchedulerClosedError (503)

Which cache a request uses: a named agent (``agent``) keeps its own cache,
on disk and across restarts, under an id namespaced by its tenant; with no
name, the request is an anonymous agent whose cache is never saved, and it
starts from whatever whole-block prefix its tenant's requests left in the
pool (automatic prefix caching). A tenant's key and ``cache_salt`` salt the
block hashes, so no tenant can hit another's blocks.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
import uuid
from collections import deque
from pathlib import Path

from semantic.errors import InvalidRequestError
from semantic.fingerprint import weights_fingerprint
from semantic.request import Request
from semantic.serve.protocol import Final, GenerateRequest, Prepared
from semantic.serve.textstream import TextStream

# ---------------------------------------------------------------- the backend

log = logging.getLogger(__name__)

ANON = "~anon/"          # anonymous agents' ids: never saved, never listed
DEFAULT_CONTEXT = 4096   # when the model's config names no context length


def model_fingerprint(path: Path) -> str:
    """The weights' fingerprint (the harness's, :mod:`semantic.fingerprint`) plus the model's config."""
    h = hashlib.sha256(weights_fingerprint(path).encode())
    config = path / "config.json"
    if config.exists():
        h.update(b"config\0" + config.read_bytes())
    return h.hexdigest()[:24]


class Backend:
    """A model, its cache store and a :class:`ConcurrentScheduler`, for the HTTP routes."""

    def __init__(self, model, tokenizer, store, *, model_id: str, max_batch: int = 8, max_queued: int = 64,
                 max_context: int | None = None, sync_saves: bool = False, ram_budget_bytes: int | None = None,
                 prefill_chunk: int | None = None):
        from semantic.scheduler import ConcurrentScheduler

        self.model_id = model_id
        self.tokenizer = tokenizer
        self.store = store
        self.scheduler = ConcurrentScheduler(model, tokenizer, store, max_batch=max_batch, max_queued=max_queued,
                                             ram_budget_bytes=ram_budget_bytes, prefill_chunk=prefill_chunk)
        self.eos = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self.vocab_size = self.scheduler.engine.vocab_size
        args = getattr(model, "args", None)
        native = getattr(args, "max_position_embeddings", None) or DEFAULT_CONTEXT
        self.context_length = int(min(max_context or native, native))
        self.closing = False
        self.sync_saves = sync_saves  # Final waits until the agent's cache file is written
        self.started = time.time()
        self._lock = threading.Lock()  # _recent and _seen: the event loop writes, stats() reads on a thread
        self._recent: deque[dict] = deque(maxlen=64)
        self._seen: dict[str, tuple[int, float]] = {}   # agent id -> (cached tokens, last used)
        self._generated = 0

    @classmethod
    def from_model(cls, model: str, *, model_id: str | None = None, cache_dir: str | None = None,
                   pool_bytes: int, ram_budget_bytes: int, disk_budget_bytes: int,
                   max_batch: int = 8, max_queued: int = 64, max_context: int | None = None,
                   block_tokens: int = 256, sync_saves: bool = False,
                   prefill_chunk: int | None = None) -> "Backend":
        """Load ``model`` (a directory or hub id, whatever ``mlx_lm.load`` takes) and open its cache store.

        Caches live under ``cache_dir``, by default
        ``~/.cache/semantic-kv/agents/<model fingerprint>``, so another
        model's files never mix with this one's. ``ram_budget_bytes`` is the
        scheduler's budget for resident caches (``semantic.residency``, ``semantic.planner``); the
        pool (``pool_bytes``) bounds every cache together, so a budget above
        it never binds.
        """
        import mlx_lm

        from semantic import compat
        from semantic.pool import BlockPool
        from semantic.spec import ModelCacheSpec
        from semantic.store import AgentCacheStore

        path = compat.model_path(model)
        fingerprint = model_fingerprint(path)
        loaded, tokenizer = mlx_lm.load(str(path))
        spec = ModelCacheSpec.from_model(loaded)
        block_bytes = spec.token_bytes() * block_tokens
        total = int(pool_bytes // block_bytes)
        if total < 4:
            raise ValueError(f"a pool of {pool_bytes} bytes holds {total} blocks of {block_bytes:.0f} bytes: raise it")
        root = Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "semantic-kv" / "agents" / fingerprint
        store = AgentCacheStore(root, spec, fingerprint, disk_budget_bytes, pool=BlockPool(spec, total, block_tokens))
        if store.quarantined or store.foreign:
            log.warning("cache dir %s: %d files quarantined, %d of another model left alone",
                        root, len(store.quarantined), len(store.foreign))
        name = model_id or (path.name if Path(model).expanduser().is_dir() else model)
        log.info("serving %s from %s: %d blocks of %d tokens (%.0f MB), caches in %s",
                 name, path, total, block_tokens, total * block_bytes / 1e6, root)
        return cls(loaded, tokenizer, store, model_id=name, max_batch=max_batch, max_queued=max_queued,
                   max_context=max_context, sync_saves=sync_saves, ram_budget_bytes=ram_budget_bytes,
                   prefill_chunk=prefill_chunk)

    # ------------------------------------------------------------ requests

    def prepare(self, req: GenerateRequest) -> Prepared:
        """Tokenize and check ``req``; nothing is queued. Raises InvalidRequestError (400)."""
        from semantic.blockplan import salt_root_of
        from semantic.errors import ContextLengthError, InvalidAgentIdError
        from semantic.request import MAX_AGENT_ID, render_chat, validate_agent_id

        if req.messages is not None:
            try:
                ids = render_chat(self.tokenizer, req.messages)
            except InvalidRequestError:
                raise
            except Exception as exc:  # the chat template's own refusal (a jinja error): the messages are at fault
                raise InvalidRequestError(f"the model's chat template refused these messages: {exc}"[:500]) from None
        elif isinstance(req.prompt, str):
            ids = list(self.tokenizer.encode(req.prompt))
        else:
            ids = list(req.prompt)
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {self.vocab_size}): {bad[:5]}")
        if not ids:
            raise InvalidRequestError("the prompt is empty: send at least one token")
        total = len(ids) + req.max_tokens
        if total > self.context_length:
            raise ContextLengthError(
                f"This model's maximum context length is {self.context_length} tokens. However, you requested "
                f"{total} tokens ({len(ids)} in the prompt, {req.max_tokens} for the completion). "
                f"Please reduce the length of the messages or completion."
            )
        bt, groups = self.store.block_tokens, len(self.store.spec.groups())
        if (-(-total // bt) + 1) * groups > self.store.total_blocks:
            raise ContextLengthError(
                f"{total} tokens do not fit this server's block pool ({self.store.total_blocks} blocks of {bt} "
                f"tokens): shorten the request, or restart the server with a larger --pool-mb"
            )
        if req.agent is not None:
            tenant = req.tenant or "public"
            agent_id = f"{tenant}/{req.agent}"
            if len(agent_id) > MAX_AGENT_ID:
                raise InvalidAgentIdError(f"agent id {req.agent[:40]!r}... is too long (at most {MAX_AGENT_ID - len(tenant) - 1} characters)")
            validate_agent_id(agent_id)
            keep = True
        else:
            agent_id, keep = ANON + uuid.uuid4().hex, False
        salt = f"{req.tenant}\0{req.cache_salt}" if req.tenant or req.cache_salt else None
        return Prepared(req, tuple(ids), agent_id, keep, salt_root_of(salt))

    async def stream(self, prepared: Prepared):
        """The turn's deltas, then its :class:`Final`. Closing this generator early cancels the turn."""
        from semantic.errors import SchedulerClosedError

        if self.closing:
            raise SchedulerClosedError("the server is shutting down")
        req = prepared.request
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        text = TextStream(self.tokenizer, req.stop, req.logprobs, req.sampling.top_logprobs if req.logprobs else 0, self.eos)

        def post(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:
                pass  # the event loop is gone (shutdown): nobody is listening

        def on_token(token: int, logprob: float, row) -> bool:
            delta = text.feed(token, logprob, row)
            if delta is not None:
                post(delta)
            return text.stopped

        done, admitted = object(), {}
        future = self.scheduler.submit(Request(
            prepared.agent_id, prepared.ids, req.max_tokens, sampling=req.sampling, persist=prepared.keep,
            salt_root=prepared.salt_root, on_token=on_token, on_admit=lambda cached: admitted.setdefault("cached", cached),
        ))
        future.add_done_callback(lambda _: post(done))
        first = True
        try:
            while (item := await queue.get()) is not done:
                if first:  # admission ran on the worker before any token: the cache hit is known
                    item.cached_tokens, first = admitted.get("cached"), False
                yield item
            result = future.result()
            if self.sync_saves and prepared.keep and result.cache_saved:
                await asyncio.to_thread(self.scheduler.wait_saved, prepared.agent_id, 120.0)
            tail = text.finish()
            if tail is not None:
                yield tail
            yield self._final(prepared, result, text)
        finally:
            if not future.done():
                self.scheduler.cancel(future)

    def _final(self, prepared: Prepared, result, text: TextStream) -> Final:
        reason = "stop" if text.stopped else result.finish_reason
        now = time.time()
        with self._lock:
            self._generated += len(result.token_ids)
            if prepared.keep and result.cache_saved:
                self._seen[prepared.agent_id] = (len(prepared.ids) + len(result.token_ids), now)
            self._recent.append(self._recent_entry(prepared, result, now))
        return Final(
            text=text.text[: text.cut] if text.cut is not None else text.text,
            finish_reason=reason, stop_sequence=text.stop_sequence,
            prompt_tokens=len(prepared.ids), cached_tokens=result.cached_tokens,
            completion_tokens=len(result.token_ids), ttft_s=result.ttft_s, latency_s=result.latency_s,
            agent=prepared.request.agent,
        )

    @staticmethod
    def _recent_entry(prepared: Prepared, result, now: float) -> dict:
        return {
            "at": now, "ttft_s": result.ttft_s, "prompt_tokens": len(prepared.ids),
            "cached_tokens": result.cached_tokens, "completion_tokens": len(result.token_ids),
            "api": prepared.request.api or ("chat" if prepared.request.messages is not None else "completions"),
        }

    # ------------------------------------------------------------ state

    def stats(self, tenant: str | None = None) -> dict:
        """Counters and what the caches hold now (agents of ``tenant`` only, when given)."""
        s = self.scheduler.stats()
        store = self.store.stats()
        with self.store.pool_lock:
            pool = self.store.pool.stats()
        block_bytes = self.store.spec.token_bytes() * self.store.block_tokens
        prefix = f"{tenant or 'public'}/" if tenant is not None else None
        agents = []
        now = time.time()
        for agent_id in self.store.agents():
            if agent_id.startswith(ANON) or (prefix is not None and not agent_id.startswith(prefix)):
                continue
            with self._lock:
                seen = self._seen.get(agent_id)
            tokens, used = seen or self._from_disk(agent_id)
            agents.append({
                "agent": agent_id.split("/", 1)[1] if "/" in agent_id else agent_id,
                "cached_tokens": tokens, "age_s": round(now - used, 1) if used else None,
                "where": "ram" if self.scheduler.resident_cache(agent_id) is not None else "disk",
            })
            if len(agents) >= 200:
                break
        agents.sort(key=lambda a: a["age_s"] if a["age_s"] is not None else 1e18)
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
                     "block_tokens": self.store.block_tokens, "used_bytes": pool.used_bytes,
                     "capacity_bytes": int(pool.total * block_bytes)},
            # resident caches: distinct pool blocks counted once, sampled after every scheduler step for the peak
            "ram": {"agents": s.resident_agents, "bytes": s.resident_bytes, "budget_bytes": s.ram_budget_bytes,
                    "peak_bytes": s.resident_peak_bytes, "budget_evictions": s.budget_evictions,
                    "budget_waits": s.budget_waits, "over_budget_steps": s.over_budget_steps,
                    "over_budget_reason": s.over_budget_reason},
            "disk": {"agents": store.disk_agents, "bytes": store.disk_bytes, "budget_bytes": self.store.disk_budget,
                     "dir": str(self.store.dir)},
            "saves": {"done": s.saves, "errors": s.save_errors, "pending": s.pending_saves},
            "evictions": s.evictions + store.disk_evictions,
            "quarantined": store.quarantined,
            "agents": agents,
            "recent": recent,
        }

    def _from_disk(self, agent_id: str) -> tuple[int, float | None]:
        """Cached tokens and mtime of an agent known only from its file (a restart)."""
        from semantic import cachefile
        from semantic.store import file_name

        path = self.store.dir / file_name(agent_id)
        try:
            info = cachefile.read_header(path)
            value = (info.total_tokens, path.stat().st_mtime)
        except Exception:  # a file being replaced or quarantined right now: show it without numbers
            value = (0, None)
        with self._lock:
            self._seen[agent_id] = value
        return value

    def begin_shutdown(self) -> None:
        """Stop admitting: new requests get 503 from now on."""
        self.closing = True

    async def aclose(self, timeout: float = 30.0) -> None:
        """Finish what is queued and in flight, write pending saves, stop the threads."""
        self.closing = True
        await asyncio.to_thread(self.scheduler.close, timeout)
