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

from semantic import cachefile, defaults
from semantic.admission import Residency
from semantic.blocks import AgentBlocks
from semantic.engine import BlockPoolBatchEngine
from semantic.errors import CacheError, QueueFullError, SchedulerClosedError
from semantic.request import Completion, Request
from semantic.store import AgentCacheStore
from semantic.writebehind import WriteBehind

log = logging.getLogger(__name__)


TurnResult = Completion  # the scheduler hands callers the engine's Completion, its blocks taken (see ``_finish``)


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
class _Ticket:
    """A submitted request and what the scheduler tracks of it."""

    request: Request
    future: Future
    reserved: int = 0              # pool blocks admission set aside for it
    cancelled: bool = False


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
        max_batch: int = defaults.MAX_BATCH,
        max_queued: int = defaults.MAX_QUEUED,
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
        self._queues: dict[str, deque[_Ticket]] = {}
        self._ready: deque[str] = deque()          # agents with a queued turn and none in flight
        self._queued = 0
        self._in_flight: dict[int, _Ticket] = {}  # engine uid -> request
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

    def submit(self, request: Request, *, timeout: float | None = 0.0) -> Future:
        """Queue one turn; the future gives its :class:`Completion` (``blocks`` None: the scheduler keeps them).

        The request carries the agent's whole history and everything the
        engine reads (``semantic.request``); ``on_token`` and ``on_admit``
        run on the worker thread, so they must be quick. ``persist=False``:
        an anonymous turn (see the module doc). ``timeout`` is how long to
        wait for queue space: 0 raises :class:`QueueFullError` at once, None
        waits as long as it takes.
        """
        assert isinstance(request, Request), type(request)
        ticket = _Ticket(request, Future())
        agent_id = request.agent_id
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
            self._queues.setdefault(agent_id, deque()).append(ticket)
            self._queued += 1
            self._counts["submitted"] += 1
            if agent_id not in self._busy and agent_id not in self._ready:
                self._ready.append(agent_id)
            self._cv.notify_all()
        return ticket.future

    async def submit_async(self, request: Request, *, timeout: float | None = 0.0) -> Completion:
        """:meth:`submit` for asyncio: awaits the turn's result (queue waits run off the loop)."""
        if timeout == 0.0:
            future = self.submit(request, timeout=0.0)
        else:
            future = await asyncio.to_thread(self.submit, request, timeout=timeout)
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
        req.future.set_result(Completion(
            request=req.request, uid=-1, token_ids=[], logprobs=[], finish_reason="cancelled", cached_tokens=0,
            reuse="none", blocks=None, cache_error="cancelled while queued", admitted_at=now, finished_at=now,
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
            request = req.request
            own = self._resident.own_cache(agent_id) if request.persist else None
            need = self._resident.blocks_needed(request.ids, request.max_tokens, request.salt_root)
            if not self._resident.make_room(need, agent_id, self._reservations):
                return  # stays queued until a finish frees blocks
            uid = self.engine.submit(request, own)
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
        if request.on_admit is not None:
            try:
                request.on_admit(self.engine.cached_tokens(uid))
            except Exception:  # a caller's bug: its turn still runs
                log.exception("on_admit of agent %r raised", agent_id)

    def _unqueue(self, future: Future) -> _Ticket | None:
        """Take the queued request of ``future`` off its agent's queue (the caller holds ``_cv``)."""
        for agent_id, queue in list(self._queues.items()):
            req = next((r for r in queue if r.future is future), None)
            if req is not None:
                self._take(agent_id, req)
                if agent_id not in self._queues and agent_id in self._ready:
                    self._ready.remove(agent_id)
                return req
        return None

    def _dequeue(self, agent_id: str, req: _Ticket) -> bool:
        """Take ``req``, being admitted, off its agent's queue; the agent leaves the ready list
        (the caller holds ``_cv``). False when cancel() took it off first."""
        found = self._take(agent_id, req)
        if agent_id in self._ready:
            self._ready.remove(agent_id)
        self._cv.notify_all()
        return found

    def _take(self, agent_id: str, req: _Ticket) -> bool:
        """Remove ``req`` from the agent's queue if it is there (the caller holds ``_cv``)."""
        queue = self._queues.get(agent_id)
        if queue is None or req not in queue:  # _Ticket compares by identity
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
        # the cache is the scheduler's from here: resident and saved, never the caller's
        blocks, c.blocks = c.blocks, None
        prepared = None
        keep = c.request.persist and blocks is not None
        if keep and self.write_behind:
            try:
                prepared = cachefile.prepare(blocks)  # MLX work stays on this thread
            except CacheError as exc:
                log.warning("agent %r: cannot prepare its save: %s", c.agent_id, exc)
        replaced = []  # released when nothing else holds them (AgentBlocks' finalizer), after _cv
        with self._cv:
            self._busy.discard(c.agent_id)
            if keep:
                replaced.append(self._resident.put(c.agent_id, blocks))
                if prepared is not None:  # a newer save replaces a pending older one
                    replaced.append(self._saver.put(c.agent_id, blocks, prepared))
            self._counts["completed"] += 1
            self._counts["cancelled"] += c.finish_reason == "cancelled" and not answered
            self._counts["prompt_tokens"] += c.prompt_tokens
            self._counts["cached_tokens"] += c.cached_tokens
            if self._queues.get(c.agent_id) and c.agent_id not in self._ready:
                self._ready.append(c.agent_id)
            self._cv.notify_all()
        del replaced, blocks
        if not answered:
            req.future.set_result(c)

    def _fail_in_flight(self, exc: BaseException) -> None:
        with self._cv:
            failed = list(self._in_flight.values())
            self._in_flight.clear()
            for req in failed:
                agent_id = req.request.agent_id
                self._busy.discard(agent_id)
                if self._queues.get(agent_id) and agent_id not in self._ready:
                    self._ready.append(agent_id)
            self._counts["failed"] += len(failed)
            self._cv.notify_all()
        self.engine = self._make_engine()  # over the same pool: stored caches stay valid
        for req in failed:
            if not req.future.done():
                req.future.set_exception(exc)
