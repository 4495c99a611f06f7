"""What the scheduler does next, decided from plain state: the step plan.

The scheduler's worker asks, once per pass, which queued turns start, which
running ones end, and which resident caches go; it then does what the plan
says (threads, locks, the model: ``semantic.sched.scheduler``). Deciding takes no
lock and starts no thread, so every rule below is tested with plain values
(``tests/semantic/sched/test_planner.py``). This is also where a step's token budget
belongs.

Admission. A turn starts only when the pool can hold its cache beyond what
the turns in flight reserved; otherwise it waits for a finish, or, with
nothing in flight, a resident cache that is safely on disk goes (least
recently used first; the store reloads it on its next turn)::

    need = bytes of the prompt's blocks the pool misses and of those max_tokens may fill
           (semantic.cache.room: the accounting admission's longest cache comes from)
         + the copy of its cache a turn holds when it cannot run in the pool's buffers
           (CacheManager.live_bytes: another turn has them, a history of several, a kind that copies)
         + what a merged batch grows by when it joins other turns (room.merged_bytes)
    need > the pool               the turn fails: it can never fit (TurnTooLargeError, a 400)
    free - reserved >= need       admit (reserve need)
    turns in flight               wait for a finish
    a cache on disk, not busy     evict it, then plan again
    a save under way              wait for it, then plan again
    a cache whose save failed     drop it, counted as lost, then plan again
    else                          the turn fails (PoolExhaustedError)

The RAM budget (``budget``; None: the pool is the only bound) holds after
every pass: the turns that finished in the step are resident by then, and
:meth:`StepPlanner.plan_budget` evicts until it holds::

    resident bytes <= budget      done
    a cache already on disk       evict the least recently used one (busy or not:
                                  the executor rebuilt a busy agent's cache at admission)
    else, a save is under way     wait for the saver (no step meanwhile)
    else                          drop the least recently used cache whose save failed
                                  (the disk is full or gone), counted as lost

A pinned cache is never evicted to make room: its agent has a turn in
flight, or its cache is not on disk (a save pending, being written, or
failed: ``SaveState.unsaved``). Memory stays bounded when nothing can be
saved: a cache whose save failed, and that no save is pending for, is the
last to go, and goes (``SaveState.lost``). Its agent's next turn starts from
its last file on disk, if any, and prefills the rest.
"""

from __future__ import annotations

from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from semantic.cache.manager import merged_bytes, size
from semantic.cache.blocks import AgentBlocks
from semantic.errors import PoolExhaustedError, TurnTooLargeError
from semantic.request import Completion, Request
from semantic.sched.residency import Residency
from semantic.sched.saves import SaveState


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
    resident_bytes: int = 0          # distinct pool blocks of resident caches (``semantic.sched.residency``)
    resident_peak_bytes: int = 0     # the most resident bytes after any pass
    ram_budget_bytes: int | None = None
    budget_evictions: int = 0        # saved caches evicted to hold the budget
    budget_waits: int = 0            # times the worker waited for a save to hold it
    budget_wait_s: float = 0.0
    over_budget_steps: int = 0       # passes that ended over the budget anyway ...
    over_budget_reason: str | None = None  # ... and why (the last time)
    steps: int = 0                   # executor steps of the worker: each pass ends with the budget check and a sample
    lost_caches: int = 0             # caches dropped unsaved under memory pressure (their save had failed)
    prefix_saves: int = 0            # prefixes saved as entries of their own (``Scheduler._keep_prefix``)

    @property
    def token_hit_rate(self) -> float:
        """Share of history tokens served from a cache instead of prefilled."""
        total = self.prompt_tokens + self.cached_tokens
        return self.cached_tokens / total if total else 0.0


@dataclass(slots=True, eq=False)
class Ticket:
    """A submitted request and what the scheduler tracks of it (compared by identity)."""

    request: Request
    future: Future
    reserved: int = 0        # pool bytes admission set aside for it
    row: int = 0             # its row's bytes in a merged batch (``room.row_bytes``)
    cancelled: bool = False  # end it at the next step (cancel() found it running)


@dataclass(slots=True)
class StepPlan:
    """What the worker does next; empty fields: nothing of that kind."""

    admit: list[tuple[Ticket, int]] = field(default_factory=list)      # start, reserving that many pool bytes
    fail: list[tuple[Ticket, Exception]] = field(default_factory=list)  # answer with this error
    evict: str | None = None         # drop this resident cache, then plan again
    wait_for_save: bool = False      # only a save under way can help: wait for it, then plan again

    def __bool__(self) -> bool:
        return bool(self.admit or self.fail or self.evict or self.wait_for_save)


class StepPlanner:
    """The scheduler's state and its rules (see the module doc). The caller guards every call with one lock.

    Args:
        max_batch: turns in flight at once.
        max_queued: turns that may wait (all agents together).
        capacity: the pool's bytes.
        budget: most bytes resident caches may hold after each pass; None: no budget.
    """

    def __init__(self, *, max_batch: int, max_queued: int, capacity: int, budget: int | None = None):
        if max_batch <= 0 or max_queued <= 0:
            raise ValueError(f"max_batch and max_queued must be positive, got {max_batch}, {max_queued}")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(f"the RAM budget must be a number of bytes >= 0 or None, got {budget!r}")
        self.max_batch, self.max_queued, self.capacity, self.budget = max_batch, max_queued, capacity, budget
        self.residency = Residency()
        self.saves = SaveState()
        self._queues: dict[str, deque[Ticket]] = {}
        self._ready: deque[str] = deque()          # agents with a queued turn and none in flight
        self.queued = 0
        self.in_flight: dict[int, Ticket] = {}     # executor uid -> ticket
        self._busy: set[str] = set()               # agents with a turn in flight
        self.counts: Counter[str] = Counter()
        self.over_budget_reason: str | None = None
        self.budget_wait_s = 0.0

    # ------------------------------------------------------------ callers

    @property
    def full(self) -> bool:
        return self.queued >= self.max_queued

    def enqueue(self, ticket: Ticket) -> None:
        assert not self.full
        agent_id = ticket.request.agent_id
        self._queues.setdefault(agent_id, deque()).append(ticket)
        self.queued += 1
        self.counts["submitted"] += 1
        if agent_id not in self._busy and agent_id not in self._ready:
            self._ready.append(agent_id)

    def cancel(self, future: Future) -> Ticket | bool:
        """Cancel the turn of ``future``: the queued ticket taken off its queue (answer it),
        True for a running one (marked: it ends at the next step), False if none is found."""
        running = next((t for t in self.in_flight.values() if t.future is future), None)
        if running is not None:
            running.cancelled = True
            return True
        for agent_id, queue in list(self._queues.items()):
            ticket = next((t for t in queue if t.future is future), None)
            if ticket is not None:
                self._take(agent_id, ticket)
                if agent_id not in self._queues and agent_id in self._ready:
                    self._ready.remove(agent_id)
                self.counts["cancelled"] += 1
                return ticket
        return False

    def holds(self, agent_id: str) -> bool:
        """Whether the agent has a turn queued or in flight."""
        return agent_id in self._busy or agent_id in self._queues

    def pinned(self, agent_id: str) -> bool:
        """Whether the agent's cache must stay resident: a turn in flight, or not on disk."""
        return agent_id in self._busy or self.saves.unsaved(agent_id)

    # ------------------------------------------------------------ the worker's pass

    @property
    def idle(self) -> bool:
        return not self._ready and not self.in_flight

    def heads(self) -> list[Ticket]:
        """The next turn of each ready agent, oldest agent first, while the batch has room."""
        if len(self.in_flight) >= self.max_batch:
            return []
        out = []
        for agent_id in list(self._ready):
            queue = self._queues.get(agent_id)
            if agent_id in self._busy or not queue:
                self._ready.remove(agent_id)
                continue
            out.append(queue[0])
        return out

    def plan(self, free: int, needs: dict[Ticket, int], rows: dict[Ticket, int] | None = None) -> StepPlan:
        """Which of the ``needs`` tickets (heads, in order, with the pool bytes each needs) start now
        with ``free`` pool bytes, and what must happen first when none can (the module doc). A ticket with a
        row in ``rows`` (its bytes in a merged batch) that would join others also reserves what the merged
        batch grows by (``room.merged_bytes``); alone, it decodes in its own buffers."""
        plan = StepPlan()
        reserved = [t.reserved for t in self.in_flight.values()]
        batch = [t.row for t in self.in_flight.values()]
        room = self.max_batch - len(self.in_flight)
        for ticket, need in needs.items():
            if room <= 0:
                break
            if need > self.capacity:
                plan.fail.append((ticket, TurnTooLargeError(
                    f"this turn needs up to {size(need)} of the KV pool (its new blocks, and any copy of its "
                    f"cache it cannot run in place) but the pool has {size(self.capacity)}: start the server "
                    f"with a larger pool, or send a shorter prompt")))
                continue
            row = (rows or {}).get(ticket, 0)
            merge = merged_bytes(batch + [row]) - merged_bytes(batch) if row else 0
            if free - sum(reserved) >= need + merge:
                plan.admit.append((ticket, need + merge))
                reserved.append(need + merge)
                batch.append(row)
                room -= 1
                continue
            if reserved:
                continue  # a finish frees blocks: it waits for one
            room_plan = self.make_room(exclude=ticket.request.agent_id)
            if room_plan is None:
                plan.fail.append((ticket, PoolExhaustedError(
                    f"this turn needs {size(need)} of free blocks; {size(free)} are free and every cached"
                    " agent is busy or not yet saved: raise the pool or lower max_batch")))
                continue
            plan.evict, plan.wait_for_save = room_plan.evict, room_plan.wait_for_save
            break
        return plan

    def make_room(self, exclude: str) -> StepPlan | None:
        """Free pool blocks: evict the least recently used resident cache that may go (not ``exclude``'s,
        not pinned), else wait for a save under way, else drop one whose save failed (lost); None when
        nothing can make room."""
        victim = next((a for a in self.residency if a != exclude and not self.pinned(a)), None)
        if victim is not None:
            return StepPlan(evict=victim)
        if self.saves.busy:
            return StepPlan(wait_for_save=True)
        victim = next((a for a in self.residency if a != exclude and a not in self._busy and self.saves.failed(a)),
                      None)
        return self._lose(victim) if victim is not None else None

    def _lose(self, agent_id: str) -> StepPlan:
        """Evict a cache that is not on disk: its turns since its last file are lost (counted)."""
        self.saves.forget(agent_id)
        return StepPlan(evict=agent_id)

    def started(self, ticket: Ticket, uid: int, reserved: int, row: int = 0) -> None:
        """``ticket`` runs in the executor as ``uid``, holding ``reserved`` pool bytes and a batch ``row``."""
        agent_id = ticket.request.agent_id
        # cancel() may have taken it off the queue while it was being admitted: end it at the next step
        ticket.cancelled = not self._take(agent_id, ticket)
        if agent_id in self._ready:
            self._ready.remove(agent_id)
        ticket.reserved, ticket.row = reserved, row
        self._busy.add(agent_id)
        self.in_flight[uid] = ticket

    def not_started(self, ticket: Ticket) -> None:
        """``ticket`` failed before it ran; the agent's next turn may still run."""
        agent_id = ticket.request.agent_id
        self._take(agent_id, ticket)
        if agent_id in self._ready:
            self._ready.remove(agent_id)
        if self._queues.get(agent_id):
            self._ready.append(agent_id)
        self.counts["failed"] += 1

    def cancelled(self) -> list[int]:
        """Executor uids of running turns to end before the next step."""
        return [uid for uid, t in self.in_flight.items() if t.cancelled]

    def keeps(self, c: Completion) -> bool:
        """Whether a finished turn's cache stays resident and is saved (a named agent's, if one was made)."""
        return c.request.persist and c.blocks is not None

    def finish(self, uid: int, c: Completion, blocks: AgentBlocks | None, prepared) -> tuple[Ticket, list]:
        """Turn ``uid`` finished as ``c``: its ticket, and the caches its new one replaced (release them
        outside the lock). ``blocks`` are kept resident when not None, and saved with ``prepared``
        (``c.save_number`` is then its save's)."""
        ticket = self.in_flight.pop(uid)
        agent_id = c.request.agent_id
        self._busy.discard(agent_id)
        replaced = []
        if blocks is not None:
            replaced.append(self.residency.put(agent_id, blocks))
            if prepared is not None:  # a newer save replaces a pending older one
                c.save_number, older = self.saves.put(agent_id, blocks, prepared)
                replaced.append(older)
        self.counts["completed"] += 1
        self.counts["cancelled"] += c.finish_reason == "cancelled" and not ticket.future.done()
        self.counts["prompt_tokens"] += c.prompt_tokens
        self.counts["cached_tokens"] += c.cached_tokens
        if self._queues.get(agent_id) and agent_id not in self._ready:
            self._ready.append(agent_id)
        return ticket, replaced

    def fail_in_flight(self) -> list[Ticket]:
        """Every running turn failed with its step: their tickets; their agents' next turns may run."""
        failed = list(self.in_flight.values())
        self.in_flight.clear()
        for t in failed:
            agent_id = t.request.agent_id
            self._busy.discard(agent_id)
            if self._queues.get(agent_id) and agent_id not in self._ready:
                self._ready.append(agent_id)
        self.counts["failed"] += len(failed)
        return failed

    def stats(self, steps: int) -> SchedulerStats:
        """The counters and the state now; ``steps``: the worker's executor steps so far."""
        c, r, s = self.counts, self.residency, self.saves
        return SchedulerStats(
            submitted=c["submitted"], completed=c["completed"], failed=c["failed"], rejected=c["rejected"],
            queued=self.queued, in_flight=len(self.in_flight),
            prompt_tokens=c["prompt_tokens"], cached_tokens=c["cached_tokens"],
            saves=s.saves, save_errors=s.errors, pending_saves=s.outstanding(), lost_caches=s.lost,
            prefix_saves=s.prefixes,
            resident_agents=len(r), evictions=c["evictions"], cancelled=c["cancelled"],
            resident_bytes=r.bytes, resident_peak_bytes=r.peak_bytes, ram_budget_bytes=self.budget,
            budget_evictions=c["budget_evictions"], budget_waits=c["budget_waits"], budget_wait_s=self.budget_wait_s,
            over_budget_steps=c["over_budget_steps"], over_budget_reason=self.over_budget_reason, steps=steps,
        )

    def _take(self, agent_id: str, ticket: Ticket) -> bool:
        """Take ``ticket`` off its agent's queue if it is there (False: cancel() took it first)."""
        queue = self._queues.get(agent_id)
        if queue is None or ticket not in queue:
            return False
        queue.remove(ticket)
        self.queued -= 1
        if not queue:
            del self._queues[agent_id]
        return True

    # ------------------------------------------------------------ resident caches

    def own_cache(self, agent_id: str) -> AgentBlocks | None:
        """The agent's newest cache if the scheduler holds it (resident, else pending a save); None: ask the store."""
        own = self.residency.get(agent_id)
        if own is not None:
            self.residency.touch(agent_id)
            return own
        return self.saves.pending(agent_id)

    def drop(self, agent_id: str) -> AgentBlocks | None:
        """Evict the agent's resident cache (the caller releases it outside the lock)."""
        dropped = self.residency.pop(agent_id)
        self.counts["evictions"] += dropped is not None
        return dropped

    def plan_budget(self) -> StepPlan:
        """One step toward the RAM budget (the module doc): evict, wait for a save, or nothing."""
        if self.budget is None or self.residency.bytes <= self.budget:
            return StepPlan()
        victim = next((a for a in self.residency if not self.saves.unsaved(a)), None)
        if victim is not None:
            self.counts["budget_evictions"] += 1
            return StepPlan(evict=victim)
        if self.saves.busy:  # the oldest unsaved cache is written first: it becomes evictable
            self.counts["budget_waits"] += 1
            return StepPlan(wait_for_save=True)
        victim = next((a for a in self.residency if self.saves.failed(a)), None)
        if victim is not None:  # nothing can be saved (the disk is full or gone): the memory bound wins
            self.counts["budget_evictions"] += 1
            return self._lose(victim)
        self.counts["over_budget_steps"] += 1
        self.over_budget_reason = (
            f"{self.residency.bytes} resident bytes over a budget of {self.budget}, and no cache left that may go"
        )
        return StepPlan()
