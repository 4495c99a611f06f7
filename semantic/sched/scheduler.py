"""Many agents' turns through one executor: a worker that does what the step planner decides.

Callers on any thread (or asyncio task) submit a :class:`~semantic.request.Request`
(an agent's whole history and everything the executor reads). One worker
thread owns the executor and does every MLX call; a saver thread writes
finished caches through the ``AgentCacheStore`` behind it::

    submit(a) ─► planner: queue[a] ─┐      ┌─► future(a).tokens: its last token read (no blocks yet)
    submit(b) ─► planner: queue[b] ─┼─► worker: plan ─► admit / evict ─► executor.step_once() ─► finish
    submit(a) ─► (waits: one turn in flight per agent, in order)      │ future(a): the Completion, its
                                                                      │ own cache resident, saved
                                                                      └─► saver: store.save (write-behind)

A turn answers twice (:class:`~semantic.sched.turnfuture.TurnFuture`): its
``tokens`` as soon as its last token is read, the turn once its cache is
kept; the agent's next turn waits for the second.

What runs, waits, fails or is evicted is the planner's decision
(``semantic.sched.planner``: admission, the RAM budget, pinned caches), made from
plain state under the one lock this class holds; this class does what it
says. Where each turn's starting cache comes from (held here, another
server's, the agent's file, a shared prefix) is ``semantic.sched.origin``.

Backpressure is bounded everywhere. At most ``max_queued`` requests wait;
``submit`` then raises :class:`QueueFullError`, or waits up to ``timeout``.
Pending saves are bounded by the agents that have one (a newer save of an
agent replaces its older pending one). ``ram_budget_bytes`` bounds the
resident caches, the one RAM tier (``semantic.sched.residency``); other threads
read them, or evict one, through ``semantic.sched.residentview``.

:meth:`ConcurrentScheduler.cancel` ends a queued or running turn (a client
that went away). A request with ``persist=False`` is anonymous: it starts
from pooled prefixes like any other, but its cache is neither kept resident
nor saved; its blocks stay in the pool's free queue, where later requests
can still hit them until they are reused.

Lock order: the scheduler's condition is never held while the pool's lock
is taken (blocks are released, and the store is asked, outside it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, Sequence

from semantic.blasshare import SHARE
from semantic import cachefile, defaults, heap
from semantic.cache.blocks import AgentBlocks
from semantic.runner.executor import BatchExecutor
from semantic.errors import CacheError, PoolExhaustedError, QueueFullError, SchedulerClosedError
from semantic.decode.promptlookup import SpecConfig
from semantic.sched.origin import CacheOrigin
from semantic.sched.planner import SchedulerStats, StepPlan, StepPlanner, Ticket
from semantic.request import Completion, Request
from semantic.sched.residentview import ResidentView
from semantic.store import AgentCacheStore
from semantic.sched.turnfuture import TurnFuture, TurnResult  # noqa: F401  (TurnResult: semantic exports it from here)
from semantic.sched.writebehind import WriteBehind

log = logging.getLogger(__name__)


class ConcurrentScheduler(ResidentView):
    """Runs agents' turns in one continuous batch, keeping and saving their caches.

    Args:
        model, tokenizer: loaded with ``mlx_lm.load``.
        store: where caches live between turns and across restarts; its
            pool is the executor's pool.
        max_batch: sequences in flight at once.
        max_queued: requests that may wait (all agents together).
        prefill_chunk: prompt tokens per step, fixed; None: a step budget (``semantic.runner.stepbudget``).
        itl_target_s: with a step budget, the step time to hold while sequences decode; None: the
            device's chunk then.
        write_behind: save each finished cache on the saver thread (True),
            or not at all (False: RAM only, for measurements).
        stop_tokens: as ``BatchExecutor`` (default: the tokenizer's EOS).
        ram_budget_bytes: most bytes resident caches may hold after each
            pass (``semantic.sched.planner``); None: bounded by the pool alone.
            Needs ``write_behind``: only caches on disk are evicted.
        speculation: prompt-lookup drafts for greedy turns (``semantic.decode.promptlookup``); None: off.
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
        itl_target_s: float | None = None,
        write_behind: bool = True,
        stop_tokens: Sequence[int] | None = None,
        ram_budget_bytes: int | None = None,
        speculation: SpecConfig | None = None,
    ):
        if ram_budget_bytes is not None and not write_behind:
            raise ValueError("a RAM budget evicts only caches saved to disk: it needs write_behind=True")
        self.planner = StepPlanner(
            max_batch=max_batch, max_queued=max_queued, capacity=store.capacity, budget=ram_budget_bytes
        )
        self.store, self.tokenizer, self.write_behind = store, tokenizer, write_behind
        self._make_executor = lambda: BatchExecutor(
            model, tokenizer, store.pool, store.spec, max_batch=max_batch,
            prefill_chunk=prefill_chunk, itl_target_s=itl_target_s, stop_tokens=stop_tokens, lock=store.pool_lock,
            speculation=speculation, on_ended=self._ended, probe_memo=store.dir,
        )
        self.executor = self._make_executor()
        self._cv = threading.Condition()
        self.origin = CacheOrigin(store, self.planner, self._cv, self._plan,
                                  cache=lambda: self.executor.cache_manager,
                                  apart=lambda: getattr(self.executor, "rows_off", "") is None)
        self._closing = False
        self._steps = 0
        self._worker = threading.Thread(target=self._work, name="semantic-scheduler", daemon=True)
        self._prefixes: dict[str, set[str]] = {}  # agent -> the prefix entries its last turn saved (_keep_prefix)
        self._saver = WriteBehind(store, self.planner.saves, self._cv, lambda: self._closing and not self._worker.is_alive())
        self._worker.start()
        self._saver.start()

    # ------------------------------------------------------------ public

    @property
    def max_batch(self) -> int:
        return self.planner.max_batch

    @property
    def max_queued(self) -> int:
        return self.planner.max_queued

    def submit(self, request: Request, *, timeout: float | None = 0.0) -> TurnFuture:
        """Queue one turn; the future gives its :class:`Completion` (its ``blocks`` stay with the scheduler),
        and its ``tokens`` future the same turn as soon as its last token is read (:class:`TurnFuture`).

        ``on_token`` and ``on_admit`` run on the worker thread, so they must
        be quick. ``timeout`` is how long to wait for queue space: 0 raises
        :class:`QueueFullError` at once, None waits as long as it takes.
        """
        if not isinstance(request, Request):
            raise TypeError(f"submit takes a semantic.Request, got {type(request).__name__}")
        ticket = Ticket(request, TurnFuture())
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self.planner.full and not self._closing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self.planner.counts["rejected"] += 1
                    raise QueueFullError(
                        f"{self.planner.queued} requests are queued (max_queued={self.max_queued}); retry later or pass a timeout"
                    )
                self._cv.wait(left)
            if self._closing:
                raise SchedulerClosedError("the scheduler is closed")
            self.planner.enqueue(ticket)
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
        """End the turn ``future`` belongs to, queued or running; False if its tokens are already final.

        A queued turn leaves the queue at once; a running one ends at the
        worker's next step, keeping the exact cache of what it computed
        (see ``BatchExecutor.cancel``). Either way the future gets a
        Completion whose ``finish_reason`` is "cancelled". A turn whose last
        token was read is not cancelled: its cache completes as it would.
        """
        tokens = getattr(future, "tokens", future)
        with self._cv:
            if future.done() or tokens.done():
                return False
            found = self.planner.cancel(future)
            self._cv.notify_all()
        if not isinstance(found, Ticket):
            return found
        now = time.perf_counter()
        found.future.answer(Completion(
            request=found.request, uid=-1, token_ids=[], logprobs=[], finish_reason="cancelled", cached_tokens=0,
            reuse="none", blocks=None, cache_error="cancelled while queued", admitted_at=now, finished_at=now,
            decode=self.tokenizer.decode,
        ))
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued turn has finished and every pending save is written."""
        p = self.planner
        return self._wait_while(lambda: p.queued or p.in_flight or p.saves.busy, timeout)

    def wait_saved(self, agent_id: str, timeout: float | None = None) -> bool:
        """Wait until no save of ``agent_id`` is pending or being written (False: timed out)."""
        return self._wait_while(lambda: self.planner.saves.holds(agent_id), timeout)

    def save_outcome(self, c: Completion) -> str:
        """What became of the save of turn ``c``'s cache: "saved" (its file is written, fsynced unless the
        store is not durable), "pending", or "failed" (not kept, not written, or the disk refused it)."""
        with self._cv:
            return self.planner.saves.outcome(c.agent_id, c.save_number)

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
        with self._cv:  # the saver waits for the worker to be gone: tell it now, not at its next poll
            self._cv.notify_all()
        self._saver.join(timeout)
        with self._cv:
            resident = self.planner.residency.clear()
        del resident  # released outside the lock

    def __enter__(self) -> "ConcurrentScheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> SchedulerStats:
        with self._cv:
            return self.planner.stats(self._steps)

    # ------------------------------------------------------------ the worker

    def _work(self) -> None:
        settled = None  # the saves done when the worker last gave freed memory back
        quiet = False   # idle for heap.QUIET_S since then, nothing new: give back all of it
        kept = False    # what the last give-back kept (a turn's working buffers) is still held
        while True:
            with self._cv:
                idle = not self._closing and self.planner.idle
                saves = self.planner.saves
                done = saves.saves + saves.errors + saves.prefixes
            if idle and settled != done:
                # idle, and a turn or a save ended since: what they freed (a save holds its buffers until
                # written) leaves the process, off every turn's path; a turn's working buffers stay a moment
                # for the next turn of a burst
                heap.give_back(heap.KEEP_BYTES)
                settled, kept = done, True
            elif idle and quiet:
                heap.give_back(0)  # nothing came: the machine gets back all the process is not using
                kept = False
            quiet = False
            with self._cv:
                if not self._closing and self.planner.idle:
                    # a save's end or a submit wakes it too: the loop gives back what that save held
                    quiet = not self._cv.wait(heap.QUIET_S if kept else None)
                    continue
                if self._closing and not self.planner.in_flight and not self.planner.queued:
                    return
            self._admit()
            if self.planner.in_flight:
                self._step()
                settled = None
                with self._cv:
                    self._steps += 1
            else:
                with self._cv:  # everything waiting needs room that only a finish can free
                    if not self.planner.idle and not self.planner.in_flight:
                        self._cv.wait(0.05)
            self._hold_budget()  # after every pass: the turns that finished in it are resident now

    def _admit(self) -> None:
        """Start the turns the plan admits; make room first when it says so."""
        owns: dict[Ticket, AgentBlocks | None | bool] = {}  # read once, kept while the plan makes room
        while True:
            with self._cv:
                heads = self.planner.heads()
            if not heads:
                return
            for t in heads:
                if t not in owns:
                    owns[t] = self._starting_cache(t)
            waiting = self._reading(heads, owns)
            needs = {t: self.origin.need(t.request, owns[t]) for t in heads if owns[t] is not False and t not in waiting}
            rows = {t: self.origin.row(t.request) for t in needs} if self.planner.max_batch > 1 else None
            free = self.store.free_bytes()
            plan = self._plan(lambda: self.planner.plan(free, needs, rows))
            for ticket, need in plan.admit:
                self._start(ticket, owns[ticket], need, rows[ticket] if rows else 0)
            if not plan.evict and not plan.wait_for_save:
                return
            # an evicted agent's next turn reads its file: holding its cache here would keep the blocks
            owns = {t: o for t, o in owns.items() if t.request.agent_id != plan.evict}

    def _reading(self, heads: list[Ticket], owns: dict) -> set[Ticket]:
        """The turns that resume a cache a save of their agent still reads: they would write into its
        buffers, which MLX then copies whole. They wait for the save's bytes (a few milliseconds for a turn's
        new blocks), which the saver writes first; the worker steps the others meanwhile."""
        if not self.write_behind or not self.executor.cache_manager.writes_in_place:
            return set()
        with self._cv:
            saves = self.planner.saves
            out = {t for t in heads if owns[t] is not None and owns[t] is not False
                   and saves.reading(t.request.agent_id)}
            if out:
                saves.wanted.update(t.request.agent_id for t in out)
                self._cv.notify_all()
        return out

    def _plan(self, decide: Callable[[], StepPlan]) -> StepPlan:
        """Decide under the lock, then do the plan's failures, eviction and wait."""
        with self._cv:
            plan = decide()
            dropped = self.planner.drop(plan.evict) if plan.evict else None
            if plan.wait_for_save:
                self._cv.wait(0.1)
        del dropped  # released outside the lock
        for ticket, exc in plan.fail:
            self._fail(ticket, exc)
        return plan

    def _starting_cache(self, ticket: Ticket) -> AgentBlocks | None | bool:
        """The cache ``ticket``'s turn starts from (``semantic.sched.origin``); False: the turn failed, no room
        to read its file."""
        try:
            return self.origin.find(ticket.request)
        except PoolExhaustedError as exc:
            self._fail(ticket, exc)
            return False
        except Exception:  # a store bug must not stop the worker: the turn prefills what no cache covers
            log.exception("finding agent %r's cache failed; its turn starts without it", ticket.request.agent_id)
            return None

    def _start(self, ticket: Ticket, own: AgentBlocks | None, need: int, row: int = 0) -> None:
        try:
            uid = self.executor.submit(ticket.request, own)
        except Exception as exc:
            self._fail(ticket, exc)
            return
        with self._cv:
            self.planner.started(ticket, uid, need, row)
        on_admit = ticket.request.on_admit
        if on_admit is not None:
            try:
                on_admit(self.executor.cached_tokens(uid))
            except Exception:  # a caller's bug: its turn still runs
                log.exception("on_admit of agent %r raised", ticket.request.agent_id)

    def _fail(self, ticket: Ticket, exc: BaseException) -> None:
        with self._cv:
            self.planner.not_started(ticket)
            self._cv.notify_all()
        ticket.future.answer(exc=exc)  # unless cancelled meanwhile

    def _ended(self, c: Completion) -> None:
        """The executor read a turn's last token: answer its ``tokens`` future now, before its cache is done."""
        with self._cv:
            ticket = self.planner.in_flight.get(c.uid)
        if ticket is not None and not ticket.future.tokens.done():
            ticket.future.tokens.set_result(c)

    def _step(self) -> None:
        """End the cancelled turns, then one executor step; a failed step fails its turns."""
        try:
            with self._cv:
                cancelled = self.planner.cancelled()
            for uid in cancelled:
                completion = self.executor.cancel(uid)
                if completion is not None:
                    self._finish(completion)
            if not self.planner.in_flight:
                return
            with SHARE.stepping():  # another model's executor in this process may be stepping too
                for completion in self.executor.step_once():
                    self._finish(completion)
        except Exception as exc:  # the batch is lost; fail its requests, keep serving
            log.exception("executor step failed")
            self._fail_in_flight(exc)

    def _finish(self, c: Completion) -> None:
        # the cache is the scheduler's from here: resident and saved, never the caller's
        blocks, c.blocks = (c.blocks, None) if self.planner.keeps(c) else (None, None)
        prepared = None
        if blocks is not None and self.write_behind:
            try:
                prepared = cachefile.prepare_save(blocks)  # MLX work stays on this thread
            except CacheError as exc:
                log.warning("agent %r: cannot prepare its save: %s", c.agent_id, exc)
        with self._cv:
            ticket, replaced = self.planner.finish(c.uid, c, blocks, prepared)
            answered = ticket.future.done()  # cancelled while being admitted: cancel() already answered
            self._cv.notify_all()
        del replaced, blocks  # released when nothing else holds them (AgentBlocks' finalizer), outside the lock
        if not answered:
            ticket.future.answer(c)
        self.executor.cache_manager.let_go_left()  # old tails of the histories just replaced, after the answer
        if prepared is not None and self.executor.keeps_prefixes:
            self._keep_prefix(c.request)

    def _keep_prefix(self, request: Request) -> None:
        """Save, as entries of their own, the caches a later turn of a sliding-window model starts over from
        (a window of a block or more keeps only the end of each history in its agent's file): the prefix up to
        the block boundary at or before the system prompt's end (a new agent), the last message's start (an
        edit) and the prompt's last token but one (a regenerate, a reply the client renders otherwise), each
        once; the agent's entries from its turn before go (the system prompt's stays, any agent may use it).
        After a restart ``AgentCacheStore.load_prefix`` finds them, as the pool's blocks serve in RAM."""
        bt, ids = self.store.block_tokens, request.ids
        marks = [min(request.boundaries, default=0), max(request.boundaries, default=0), len(ids) - 1, len(ids)]
        cuts = sorted({p // bt * bt for p in marks if p // bt * bt})
        named = dict(zip(cuts, self.store.prefix_ids(ids, request.salt_root, cuts)))
        made = {pid: at for at, pid in named.items()}
        shared = named.get(min(request.boundaries, default=0) // bt * bt)  # the system prompt's, a cut when any
        old = self._prefixes.pop(request.agent_id, set()) - set(made) - {shared}
        self._prefixes[request.agent_id] = set(made) - {shared}
        for pid in old:
            self.store.delete(pid)
        for pid, at in made.items():
            with self._cv:
                known = self.planner.saves.holds(pid)
            if known or self.store.has(pid):
                continue
            blocks = self.executor.pooled(ids[:at], request.salt_root)
            if blocks is None:  # the pool no longer holds the window there
                continue
            try:
                prepared = cachefile.prepare_save(blocks)
            except CacheError as exc:
                log.warning("a prefix of %d tokens: cannot prepare its save: %s", at, exc)
                continue
            with self._cv:
                _, older = self.planner.saves.put(pid, blocks, prepared)
                self._cv.notify_all()
            del older, blocks

    def _fail_in_flight(self, exc: BaseException) -> None:
        with self._cv:
            failed = self.planner.fail_in_flight()
            self._cv.notify_all()
        self.executor = self._make_executor()  # over the same pool: stored caches stay valid
        for ticket in failed:
            ticket.future.answer(exc=exc)

    def _hold_budget(self) -> None:
        """Evict (or wait for saves) until the RAM budget holds, then sample the resident bytes."""
        while True:
            t0 = time.perf_counter()
            plan = self._plan(self.planner.plan_budget)
            if not plan:
                break
            if plan.wait_for_save:
                with self._cv:
                    self.planner.budget_wait_s += time.perf_counter() - t0
        with self._cv:
            self.planner.residency.sample()
