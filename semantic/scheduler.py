"""Many agents' turns through one engine: queues, continuous batching, write-behind saves.

Callers on any thread (or asyncio task) submit an agent's whole history (token
ids, text, or chat messages rendered with the tokenizer's template). One
worker thread owns the engine and does every MLX call; a saver thread writes
finished caches through the ``AgentCacheStore`` behind it::

    submit(a, …) ─► queue[a] ─┐                 ┌─► future(a) resolved as its sequence finishes
    submit(b, …) ─► queue[b] ─┼─► worker: admit ─► engine.step_once() ─► finished
    submit(a, …) ─► (waits: one turn in flight per agent, in order)
                                      │ own cache: resident ─► store (RAM ─► disk)
                                      └─► saver: store.save(agent, blocks)   (write-behind)

Each turn starts from the longest prefix the agent's previous cache or the
pool covers (``reuse``): an unchanged history prefills only its new tokens,
an edited one is cut at the first difference, and a new agent shares any
whole blocks another agent already holds (a common system prompt).

Backpressure is bounded everywhere. At most ``max_queued`` requests wait;
``submit`` then raises :class:`QueueFullError`, or waits up to ``timeout``.
A request is admitted only when the pool can hold its cache (reserving
blocks for its generated tokens too); otherwise it waits for sequences in
flight to finish, then resident caches that are already on disk are dropped,
and a request that still cannot fit fails with :class:`PoolExhaustedError`.
Pending saves are bounded by the agents that have one (a newer save of an
agent replaces its older pending one). ``ram_budget_bytes`` bounds the
resident caches (``admission``: what counts, and how the budget holds after
every step); the store's own RAM tier is not used, so the budget is the one
bound on agents' caches kept in RAM.

A turn may bring its own sampling settings and an ``on_token`` callback that
sees each token as it is generated (the server streams from it, and ends a
turn at a stop string); :meth:`ConcurrentScheduler.cancel` ends a queued or
running turn (a client that went away). A turn submitted with ``keep=False``
is anonymous: it starts from pooled prefixes like any other, but its cache
is neither kept resident nor saved; its blocks stay in the pool's free
queue, where later requests can still hit them until they are reused.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Sequence

from semantic import cachefile
from semantic.admission import Residency
from semantic.blocks import AgentBlocks
from semantic.engine import BlockPoolBatchEngine, Completion
from semantic.errors import CacheError, InvalidRequestError, QueueFullError, SchedulerClosedError
from semantic.requests import check_max_tokens, prompt_ids, validate_agent_id
from semantic.sampling import SamplingParams
from semantic.store import AgentCacheStore
from semantic.writebehind import WriteBehind

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TurnResult:
    """One finished turn. Times are seconds; ``ttft_s`` counts from ``submit``
    (queueing included) to the first generated token, read after evaluation."""

    agent_id: str
    text: str
    token_ids: tuple[int, ...]     # generated, the stop token included
    finish_reason: str
    logprobs: tuple[float, ...]
    history_tokens: int            # tokens of the history this turn was given
    prompt_tokens: int             # of those, prefilled now
    cached_tokens: int             # of those, taken from a cache
    reuse: str                     # where the cached tokens came from (``reuse`` sources)
    queued_s: float
    ttft_s: float
    latency_s: float
    decode_tokens_per_s: float
    cache_saved: bool              # whether the new cache was kept (False: cache_error says why)
    cache_error: str | None = None


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Counters since the scheduler started, and its state now."""

    submitted: int
    completed: int
    failed: int
    rejected: int        # submits refused by a full queue
    queued: int
    in_flight: int
    prompt_tokens: int   # prefilled over all completed turns
    cached_tokens: int   # taken from caches over all completed turns
    saves: int
    save_errors: int
    pending_saves: int
    resident_agents: int
    evictions: int       # agents dropped from RAM (to make room, to hold the budget, or asked to)
    cancelled: int = 0   # turns ended by cancel() (queued or running)
    resident_bytes: int = 0          # distinct pool blocks of resident caches (admission's module doc)
    resident_peak_bytes: int = 0     # the most resident bytes after any step
    ram_budget_bytes: int | None = None
    budget_evictions: int = 0        # saved caches evicted to hold the budget
    budget_waits: int = 0            # times the worker waited for a save to hold it
    budget_wait_s: float = 0.0
    over_budget_steps: int = 0       # steps that ended over the budget anyway ...
    over_budget_reason: str | None = None  # ... and why (the last time)
    steps: int = 0                   # engine steps of the worker: each pass ends with the budget check and a sample

    @property
    def token_hit_rate(self) -> float:
        """Share of history tokens served from a cache instead of prefilled."""
        total = self.prompt_tokens + self.cached_tokens
        return self.cached_tokens / total if total else 0.0


@dataclass(slots=True, eq=False)
class _Request:
    agent_id: str
    ids: list[int]
    max_tokens: int
    future: Future
    submitted_at: float
    admitted_at: float = 0.0
    reserved: int = 0
    sampling: SamplingParams | None = None
    on_token: Callable | None = None
    salt_root: int | None = None
    keep: bool = True
    cancelled: bool = False
    on_admit: Callable | None = None


class ConcurrentScheduler:
    """Runs agents' turns in one continuous batch, keeping and saving their caches.

    Args:
        model, tokenizer: loaded with ``mlx_lm.load``.
        store: where caches live between turns and across restarts; its
            pool is the engine's pool.
        max_batch: sequences in flight at once.
        max_queued: requests that may wait (all agents together).
        write_behind: save each finished cache on the saver thread (True),
            or not at all (False: RAM only, for measurements).
        stop_tokens: as ``BlockPoolBatchEngine`` (default: the tokenizer's EOS).
        ram_budget_bytes: most bytes resident caches may hold after each
            step (``admission``); None: bounded by the pool alone. Needs
            ``write_behind``: only caches on disk are evicted.
    """

    def __init__(
        self,
        model,
        tokenizer,
        store: AgentCacheStore,
        *,
        max_batch: int = 8,
        max_queued: int = 256,
        prefill_chunk: int | None = None,
        write_behind: bool = True,
        stop_tokens: Sequence[int] | None = None,
        ram_budget_bytes: int | None = None,
    ):
        if max_batch <= 0 or max_queued <= 0:
            raise ValueError(f"max_batch and max_queued must be positive, got {max_batch}, {max_queued}")
        if ram_budget_bytes is not None and not write_behind:
            raise ValueError("a RAM budget evicts only caches saved to disk: it needs write_behind=True")
        self.store, self.tokenizer = store, tokenizer
        self.max_batch, self.max_queued, self.write_behind = max_batch, max_queued, write_behind
        self._make_engine = lambda: BlockPoolBatchEngine(
            model, tokenizer, store.pool, store.spec, max_batch=max_batch,
            prefill_chunk=prefill_chunk, stop_tokens=stop_tokens, lock=store.pool_lock,
        )
        self.engine = self._make_engine()
        self._cv = threading.Condition()
        self._queues: dict[str, deque[_Request]] = {}
        self._ready: deque[str] = deque()          # agents with a queued turn and none in flight
        self._queued = 0
        self._in_flight: dict[int, _Request] = {}  # engine uid -> request
        self._busy: set[str] = set()
        self._counts: Counter[str] = Counter()
        self._closing = False
        self._worker = threading.Thread(target=self._work, name="semantic-scheduler", daemon=True)
        self._saver = WriteBehind(store, self._cv, lambda: self._closing, self._worker)
        # every agent's newest cache the worker holds; dropped (LRU) under pool pressure or over the RAM budget
        self._resident = Residency(
            store, self._cv, pinned=self._pinned, pending=self._saver.pending, saving=lambda: self._saver.busy,
            saved=lambda a: not self._saver.unsaved(a), budget=ram_budget_bytes,
        )
        self._steps = 0
        self._worker.start()
        self._saver.start()

    # ------------------------------------------------------------ public

    def submit(
        self,
        agent_id: str,
        prompt,
        max_tokens: int = 64,
        *,
        timeout: float | None = 0.0,
        sampling: SamplingParams | None = None,
        on_token: Callable[[int, float, object], bool] | None = None,
        salt_root: int | None = None,
        keep: bool = True,
        on_admit: Callable[[int], None] | None = None,
    ) -> Future:
        """Queue one turn of ``agent_id``; the future gives its :class:`TurnResult`.

        ``prompt`` is the agent's whole history: chat messages (rendered with
        the chat template), text (tokenized with special tokens), or token
        ids. ``timeout`` is how long to wait for queue space: 0 raises
        :class:`QueueFullError` at once, None waits as long as it takes.
        ``sampling``, ``on_token`` and ``salt_root`` go to the engine
        (``BlockPoolBatchEngine.submit_history``); ``on_token`` runs on the
        worker thread, so it must be quick, as must ``on_admit(cached_tokens)``,
        called once when the turn starts with how much of its history a cache
        covers. ``keep=False``: an anonymous turn (see the module doc). Invalid requests raise here and queue nothing.
        """
        validate_agent_id(agent_id)  # the same ids the store accepts
        check_max_tokens(max_tokens)
        ids = prompt_ids(self.tokenizer, prompt, messages=True)
        if not ids:
            raise InvalidRequestError("empty prompt")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise InvalidRequestError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        req = _Request(
            agent_id, ids, max_tokens, Future(), time.perf_counter(),
            sampling=sampling, on_token=on_token, salt_root=salt_root, keep=keep, on_admit=on_admit,
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queued >= self.max_queued and not self._closing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._counts["rejected"] += 1
                    raise QueueFullError(
                        f"{self._queued} requests are queued (max_queued={self.max_queued}); retry later or pass a timeout"
                    )
                self._cv.wait(left)
            if self._closing:
                raise SchedulerClosedError("the scheduler is closed")
            self._queues.setdefault(agent_id, deque()).append(req)
            self._queued += 1
            self._counts["submitted"] += 1
            if agent_id not in self._busy and agent_id not in self._ready:
                self._ready.append(agent_id)
            self._cv.notify_all()
        return req.future

    async def submit_async(self, agent_id: str, prompt, max_tokens: int = 64, *, timeout: float | None = 0.0) -> TurnResult:
        """:meth:`submit` for asyncio: awaits the turn's result (queue waits run off the loop)."""
        if timeout == 0.0:
            future = self.submit(agent_id, prompt, max_tokens, timeout=0.0)
        else:
            future = await asyncio.to_thread(self.submit, agent_id, prompt, max_tokens, timeout=timeout)
        return await asyncio.wrap_future(future)

    def cancel(self, future: Future) -> bool:
        """End the turn ``future`` belongs to, queued or running; False if it already finished.

        A queued turn leaves the queue at once; a running one ends at the
        worker's next step, keeping the exact cache of what it computed
        (see ``BlockPoolBatchEngine.cancel``). Either way the future gets a
        TurnResult whose ``finish_reason`` is "cancelled".
        """
        with self._cv:
            if future.done():
                return False
            running = next((r for r in self._in_flight.values() if r.future is future), None)
            if running is not None:
                running.cancelled = True  # the worker ends it at its next step
                self._cv.notify_all()
                return True
            req = self._unqueue(future)
            if req is None:
                return False
            self._counts["cancelled"] += 1
            self._cv.notify_all()
        now = time.perf_counter()
        req.future.set_result(TurnResult(
            agent_id=req.agent_id, text="", token_ids=(), finish_reason="cancelled", logprobs=(),
            history_tokens=len(req.ids), prompt_tokens=0, cached_tokens=0, reuse="none",
            queued_s=now - req.submitted_at, ttft_s=0.0, latency_s=now - req.submitted_at,
            decode_tokens_per_s=0.0, cache_saved=False, cache_error="cancelled while queued",
        ))
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued turn has finished and every pending save is written."""
        return self._wait_while(lambda: self._queued or self._in_flight or self._saver.busy, timeout)

    def wait_saved(self, agent_id: str, timeout: float | None = None) -> bool:
        """Wait until no save of ``agent_id`` is pending or being written (False: timed out)."""
        return self._wait_while(lambda: self._saver.holds(agent_id), timeout)

    def _wait_while(self, busy: Callable[[], object], timeout: float | None) -> bool:
        """Wait on ``_cv`` while ``busy()`` (checked under it); False when ``timeout`` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while busy():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Finish what was submitted, write pending saves, stop both threads."""
        self.flush(timeout)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._worker.join(timeout)
        self._saver.join(timeout)
        self._resident.clear()

    def __enter__(self) -> "ConcurrentScheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> SchedulerStats:
        with self._cv:
            c, r = self._counts, self._resident
            return SchedulerStats(
                submitted=c["submitted"], completed=c["completed"], failed=c["failed"], rejected=c["rejected"],
                queued=self._queued, in_flight=len(self._in_flight),
                prompt_tokens=c["prompt_tokens"], cached_tokens=c["cached_tokens"],
                saves=self._saver.saves, save_errors=self._saver.errors, pending_saves=self._saver.outstanding(),
                resident_agents=len(r), evictions=r.evictions, cancelled=c["cancelled"],
                resident_bytes=r.bytes, resident_peak_bytes=r.peak_bytes, ram_budget_bytes=r.budget,
                budget_evictions=r.budget_evictions, budget_waits=r.budget_waits, budget_wait_s=r.budget_wait_s,
                over_budget_steps=r.over_budget, over_budget_reason=r.over_budget_reason, steps=self._steps,
            )

    def resident_bytes(self, recount: bool = False) -> int:
        """Resident bytes now: the running count, or (``recount``) counted afresh from the resident caches."""
        with self._cv:
            return self._resident.recount() if recount else self._resident.bytes

    def evict(self, agent_id: str) -> bool:
        """Drop ``agent_id``'s cache from RAM (the scheduler's and the store's); its file stays.

        Its next turn reloads the file. Returns False (and drops nothing)
        while the agent has a turn queued or in flight or a save pending.
        """
        with self._cv:
            if self._pinned(agent_id) or agent_id in self._queues:
                return False
        self._resident.drop(agent_id)
        return True

    def resident_cache(self, agent_id: str) -> AgentBlocks | None:
        """The newest cache the scheduler holds for ``agent_id`` (read only; do not release)."""
        with self._cv:
            return self._resident.get(agent_id)

    # ------------------------------------------------------------ worker

    def _pinned(self, agent_id: str) -> bool:
        """Whether the agent's cache must stay resident to make room in the pool: a turn in flight,
        or its cache not on disk (a save pending, being written, or failed) (under ``_cv``)."""
        return agent_id in self._busy or self._saver.unsaved(agent_id)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._closing and not self._ready and not self._in_flight:
                    self._cv.wait()
                if self._closing and not self._in_flight and not self._queued:
                    return
                candidates = list(self._ready) if len(self._in_flight) < self.max_batch else []
            for agent_id in candidates:
                if len(self._in_flight) >= self.max_batch:
                    break
                self._admit(agent_id)
            if self._in_flight:
                self._step()
                with self._cv:
                    self._steps += 1
            else:
                with self._cv:  # everything waiting needs room that only a finish can free
                    if self._ready and not self._in_flight:
                        self._cv.wait(0.05)
            self._resident.fit_budget()  # after every pass: the turns that finished in it are resident now

    def _step(self) -> None:
        """End the cancelled turns, then one engine step; a failed step fails its turns."""
        try:
            with self._cv:
                cancelled = [uid for uid, r in self._in_flight.items() if r.cancelled]
            for uid in cancelled:
                completion = self.engine.cancel(uid)
                if completion is not None:
                    self._finish(completion)
            if not self._in_flight:
                return
            for completion in self.engine.step_once():
                self._finish(completion)
        except Exception as exc:  # the batch is lost; fail its requests, keep serving
            log.exception("engine step failed")
            self._fail_in_flight(exc)

    def _admit(self, agent_id: str) -> None:
        with self._cv:
            queue = self._queues.get(agent_id)
            if agent_id in self._busy or not queue:
                if agent_id in self._ready:
                    self._ready.remove(agent_id)
                return
            req = queue[0]
        try:
            own = self._resident.own_cache(agent_id) if req.keep else None
            need = self._resident.blocks_needed(req.ids, req.max_tokens, req.salt_root)
            if not self._resident.make_room(need, agent_id, self._reservations):
                return  # stays queued until a finish frees blocks
            req.admitted_at = time.perf_counter()
            uid = self.engine.submit_history(
                agent_id, req.ids, own, req.max_tokens, sampling=req.sampling, on_token=req.on_token, salt_root=req.salt_root
            )
        except Exception as exc:
            with self._cv:
                self._dequeue(agent_id, req)
                if self._queues.get(agent_id):  # its next turn may still run
                    self._ready.append(agent_id)
                self._counts["failed"] += 1
            if not req.future.done():  # not cancelled meanwhile
                req.future.set_exception(exc)
            return
        req.reserved = need
        with self._cv:
            # cancel() may have taken it off the queue while it was being admitted: end it next step
            req.cancelled = not self._dequeue(agent_id, req)
            self._busy.add(agent_id)
            self._in_flight[uid] = req
        if req.on_admit is not None:
            try:
                req.on_admit(self.engine.cached_tokens(uid))
            except Exception:  # a caller's bug: its turn still runs
                log.exception("on_admit of agent %r raised", agent_id)

    def _unqueue(self, future: Future) -> _Request | None:
        """Take the queued request of ``future`` off its agent's queue (the caller holds ``_cv``)."""
        for agent_id, queue in list(self._queues.items()):
            req = next((r for r in queue if r.future is future), None)
            if req is not None:
                self._take(agent_id, req)
                if agent_id not in self._queues and agent_id in self._ready:
                    self._ready.remove(agent_id)
                return req
        return None

    def _dequeue(self, agent_id: str, req: _Request) -> bool:
        """Take ``req``, being admitted, off its agent's queue; the agent leaves the ready list
        (the caller holds ``_cv``). False when cancel() took it off first."""
        found = self._take(agent_id, req)
        if agent_id in self._ready:
            self._ready.remove(agent_id)
        self._cv.notify_all()
        return found

    def _take(self, agent_id: str, req: _Request) -> bool:
        """Remove ``req`` from the agent's queue if it is there (the caller holds ``_cv``)."""
        queue = self._queues.get(agent_id)
        if queue is None or req not in queue:  # _Request compares by identity
            return False
        queue.remove(req)
        self._queued -= 1
        if not queue:
            del self._queues[agent_id]
        return True

    def _reservations(self) -> list[int]:
        """Blocks reserved by each turn in flight (the caller holds ``_cv``)."""
        return [r.reserved for r in self._in_flight.values()]

    def _finish(self, c: Completion) -> None:
        req = self._in_flight.pop(c.uid)
        answered = req.future.done()  # cancelled while being admitted: cancel() already answered
        prepared = None
        keep = req.keep and c.blocks is not None
        if keep and self.write_behind:
            try:
                prepared = cachefile.prepare(c.blocks)  # MLX work stays on this thread
            except CacheError as exc:
                log.warning("agent %r: cannot prepare its save: %s", c.agent_id, exc)
        result = TurnResult(
            agent_id=c.agent_id, text=c.text, token_ids=tuple(c.token_ids), finish_reason=c.finish_reason,
            logprobs=tuple(c.logprobs), history_tokens=len(req.ids), prompt_tokens=c.prompt_tokens,
            cached_tokens=c.cached_tokens, reuse=c.reuse, queued_s=req.admitted_at - req.submitted_at,
            ttft_s=c.first_token_at - req.submitted_at if c.first_token_at else 0.0, latency_s=c.finished_at - req.submitted_at,
            decode_tokens_per_s=c.decode_tokens_per_s, cache_saved=c.blocks is not None, cache_error=c.cache_error,
        )
        replaced = []  # released when nothing else holds them (AgentBlocks' finalizer), after _cv
        with self._cv:
            self._busy.discard(c.agent_id)
            if keep:
                replaced.append(self._resident.put(c.agent_id, c.blocks))
                if prepared is not None:  # a newer save replaces a pending older one
                    replaced.append(self._saver.put(c.agent_id, c.blocks, prepared))
            self._counts["completed"] += 1
            self._counts["cancelled"] += c.finish_reason == "cancelled" and not answered
            self._counts["prompt_tokens"] += c.prompt_tokens
            self._counts["cached_tokens"] += c.cached_tokens
            if self._queues.get(c.agent_id) and c.agent_id not in self._ready:
                self._ready.append(c.agent_id)
            self._cv.notify_all()
        del replaced
        if not answered:
            req.future.set_result(result)

    def _fail_in_flight(self, exc: BaseException) -> None:
        with self._cv:
            failed = list(self._in_flight.values())
            self._in_flight.clear()
            for req in failed:
                self._busy.discard(req.agent_id)
                if self._queues.get(req.agent_id) and req.agent_id not in self._ready:
                    self._ready.append(req.agent_id)
            self._counts["failed"] += len(failed)
            self._cv.notify_all()
        self.engine = self._make_engine()  # over the same pool: stored caches stay valid
        for req in failed:
            if not req.future.done():
                req.future.set_exception(exc)
