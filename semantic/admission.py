"""Which agents' caches the scheduler keeps resident, within the RAM budget and the pool.

A turn is admitted only when the pool can hold its cache beyond what the
turns in flight reserved. When it cannot, resident caches that are safely
on disk are dropped, least recently used first (the store reloads them on
their next turn); a pinned agent (a turn in flight, or its cache not on
disk: a save pending, being written, or failed) is never dropped::

    need = prompt blocks the pool misses + (max_tokens / block + 1) per layer group
    free - reserved >= need    admit
    turns in flight            wait for a finish
    else                       drop a resident cache ─► retry, or PoolExhaustedError

All pool questions go to the store (``AgentCacheStore.free_blocks``,
``blocks_to_take``), which holds its pool lock for them.

Resident bytes: the bytes of the distinct pool blocks that the resident
caches reference (each agent's newest finished cache, its save pending or
not). A block shared by several agents counts once. A sequence in flight is
not resident: its live cache is the engine's, bounded by ``max_batch`` and
admission; the previous cache of an agent with a turn in flight stays
resident (and counted) until the turn replaces it or the budget evicts it,
and a cache read from its file for a turn is that turn's, not resident. So
resident bytes grow only when a turn finishes.

The RAM budget (``budget``, None: the pool is the only bound) holds after
every pass of the scheduler's worker (an engine step and the admissions
before it): the turns that finished in the step are made resident, then
``fit_budget`` runs before the next pass::

    resident bytes <= budget   done
    a cache already on disk    evict the least recently used one (busy or not:
                               the engine rebuilt a busy agent's cache at admission)
    else, a save is under way  wait for the saver (the worker does not step meanwhile)
    else                       over budget: counted with its reason (only caches
                               whose save failed are left; they stay until saved)

An evicted cache's blocks go to the pool's free queue, still hittable until
recycled; the agent's next turn loads its file (or shares pooled blocks).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from typing import Callable

from semantic.blocks import AgentBlocks
from semantic.errors import PoolExhaustedError
from semantic.store import AgentCacheStore


class Residency:
    """Resident caches, newest use last, and the room-making that drops them.

    Every method takes ``cv`` (the scheduler's condition) for the map and
    releases dropped blocks outside it: the lock order is never ``cv`` then
    the pool lock.

    Args:
        store: the agent store (its pool is the engine's).
        cv: the scheduler's condition, notified when saves finish.
        pinned: whether an agent's cache must stay when making room in the
            pool (called under ``cv``).
        pending: the agent's cache a save is waiting on, if any (under ``cv``).
        saving: whether any save is queued or running (under ``cv``).
        saved: whether the agent's resident cache is on disk (under ``cv``);
            only those are evicted to hold the budget.
        budget: most resident bytes after each step; None: no budget.
    """

    def __init__(
        self,
        store: AgentCacheStore,
        cv: threading.Condition,
        *,
        pinned: Callable[[str], bool],
        pending: Callable[[str], AgentBlocks | None],
        saving: Callable[[], bool],
        saved: Callable[[str], bool] = lambda agent_id: False,
        budget: int | None = None,
    ):
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(f"the RAM budget must be a number of bytes >= 0 or None, got {budget!r}")
        self.store, self._cv = store, cv
        self._pinned, self._pending, self._saving, self._saved = pinned, pending, saving, saved
        self.budget = budget
        self._resident: OrderedDict[str, AgentBlocks] = OrderedDict()
        self._refs: Counter[int] = Counter()  # id(block) -> resident caches holding it
        self.bytes = 0                         # resident bytes (see the module doc)
        self.evictions = 0  # agents dropped from RAM (to make room, to hold the budget, or asked to)
        self.budget_evictions = 0
        self.budget_waits = 0           # times the worker waited for a save to hold the budget
        self.budget_wait_s = 0.0
        self.over_budget = 0            # steps that ended over the budget anyway
        self.over_budget_reason: str | None = None
        self.peak_bytes = 0             # the most resident bytes seen after any step

    def __len__(self) -> int:
        return len(self._resident)

    def get(self, agent_id: str) -> AgentBlocks | None:
        """The agent's newest cache (the caller holds ``cv``)."""
        return self._resident.get(agent_id)

    def put(self, agent_id: str, blocks: AgentBlocks) -> AgentBlocks | None:
        """Make ``blocks`` the agent's cache (the caller holds ``cv``); returns the one replaced."""
        old = self._pop(agent_id)
        self._resident[agent_id] = blocks
        for b in blocks.unique_blocks():
            if self._refs[id(b)] == 0:
                self.bytes += b.nbytes
            self._refs[id(b)] += 1
        return old

    def _pop(self, agent_id: str) -> AgentBlocks | None:
        """Take the agent's cache out of the map and the byte count (the caller holds ``cv``)."""
        blocks = self._resident.pop(agent_id, None)
        if blocks is not None:
            for b in blocks.unique_blocks():
                self._refs[id(b)] -= 1
                if self._refs[id(b)] == 0:
                    del self._refs[id(b)]
                    self.bytes -= b.nbytes
        return blocks

    def recount(self) -> int:
        """Resident bytes counted afresh from the map (checks the running count; the caller holds ``cv``)."""
        unique = {id(b): b for blocks in self._resident.values() for b in blocks.unique_blocks()}
        return sum(b.nbytes for b in unique.values())

    def fit_budget(self) -> None:
        """Evict, least recently used first, caches already on disk until the budget holds;
        wait for the saver when only unsaved caches are left (see the module doc). Then
        sample the resident bytes (``peak_bytes``). Called by the worker after every step."""
        while self.budget is not None:
            with self._cv:
                if self.bytes <= self.budget:
                    break
                victim = next((a for a in self._resident if self._saved(a)), None)
                if victim is None:
                    if self._saving():  # the oldest unsaved cache is written first: it becomes evictable
                        t0 = time.perf_counter()
                        self._cv.wait(0.1)
                        self.budget_waits += 1
                        self.budget_wait_s += time.perf_counter() - t0
                        continue
                    self.over_budget += 1
                    self.over_budget_reason = (
                        f"{self.bytes} resident bytes over a budget of {self.budget}: the {len(self._resident)} caches"
                        " left are not on disk (their save failed) and stay until a later turn saves them"
                    )
                    break
                dropped = self._pop(victim)
                self.evictions += 1
                self.budget_evictions += 1
            del dropped  # released here, outside cv
            self.store.evict(victim)
        with self._cv:
            self.peak_bytes = max(self.peak_bytes, self.bytes)

    def own_cache(self, agent_id: str) -> AgentBlocks | None:
        """The agent's newest cache: resident, pending a save, else the store's (RAM, then file).

        One read from the file is the caller's alone: it is not made resident.
        """
        with self._cv:
            own = self._resident.get(agent_id)
            if own is not None:
                self._resident.move_to_end(agent_id)
                return own
            pending = self._pending(agent_id)
            if pending is not None:
                return pending
        while True:
            try:
                own = self.store.load(agent_id, keep_in_ram=False)  # the file (a restart, an eviction), else None
                break
            except PoolExhaustedError:
                if not self.evict_one(keep=agent_id) and not self._wait_for_a_save():  # room for the file's blocks
                    raise
        # a cache read for a turn is that turn's, not resident: the turn's finish puts its successor
        return own

    def blocks_needed(self, ids: list[int], max_tokens: int, salt_root: int | None = None) -> int:
        """Free blocks a turn's cache will take at most: the prompt's misses plus its generated tokens."""
        per_group = -(-max_tokens // self.store.block_tokens) + 1
        return self.store.blocks_to_take(ids, salt_root) + per_group * len(self.store.spec.groups())

    def make_room(self, need: int, keep: str, reservations: Callable[[], list[int]]) -> bool:
        """Whether ``need`` blocks are free beyond what in-flight turns reserved
        (``reservations()``, under ``cv``), dropping resident caches that are
        safely on disk when that helps."""
        total = self.store.total_blocks
        if need > total:
            raise PoolExhaustedError(
                f"this turn needs up to {need} blocks but the pool has {total}: raise total_blocks"
            )
        while True:
            with self._cv:
                reserved = reservations()
            if self.store.free_blocks() - sum(reserved) >= need:
                return True
            if reserved:
                return False  # wait for a finish
            if not self.evict_one(keep):
                if self._wait_for_a_save():
                    continue
                raise PoolExhaustedError(
                    f"this turn needs {need} free blocks; {self.store.free_blocks()} are free and every cached agent"
                    " is busy or not yet saved: raise total_blocks or lower max_batch"
                )

    def _wait_for_a_save(self) -> bool:
        """Wait a little while a save is under way (a cache becomes evictable once it is on disk); False if none is."""
        with self._cv:
            if not self._saving():
                return False
            self._cv.wait(0.1)
            return True

    def evict_one(self, keep: str) -> bool:
        """Drop the least recently used unpinned cache but ``keep``'s; False if there is none."""
        with self._cv:
            victim = next((a for a in self._resident if a != keep and not self._pinned(a)), None)
            if victim is None:
                return False
            dropped = self._pop(victim)
            self.evictions += 1
        del dropped  # released here, outside cv (lock order: cv is never held while releasing)
        self.store.evict(victim)  # its file stays: the next turn reloads it
        return True

    def drop(self, agent_id: str) -> None:
        """Forget the agent's resident cache (the caller checked it is not pinned) and the store's RAM copy."""
        with self._cv:
            dropped = self._pop(agent_id)
            self.evictions += 1
        del dropped  # released outside cv
        self.store.evict(agent_id)

    def clear(self) -> None:
        """Release every resident cache."""
        with self._cv:
            resident, self._resident = self._resident, OrderedDict()
            self._refs.clear()
            self.bytes = 0
        resident.clear()  # releases outside cv
