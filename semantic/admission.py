"""Which agents' caches the scheduler keeps resident, and whether a turn fits in the pool.

A turn is admitted only when the pool can hold its cache beyond what the
turns in flight reserved. When it cannot, resident caches that are safely
on disk are dropped, least recently used first (the store reloads them on
their next turn); a pinned agent (a turn in flight, or a save pending) is
never dropped::

    need = prompt blocks the pool misses + (max_tokens / block + 1) per layer group
    free - reserved >= need    admit
    turns in flight            wait for a finish
    else                       drop a resident cache ─► retry, or PoolExhaustedError

All pool questions go to the store (``AgentCacheStore.free_blocks``,
``blocks_to_take``), which holds its pool lock for them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
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
        pinned: whether an agent's cache must stay (called under ``cv``).
        pending: the agent's cache a save is waiting on, if any (under ``cv``).
        saving: whether any save is queued or running (under ``cv``).
    """

    def __init__(
        self,
        store: AgentCacheStore,
        cv: threading.Condition,
        *,
        pinned: Callable[[str], bool],
        pending: Callable[[str], AgentBlocks | None],
        saving: Callable[[], bool],
    ):
        self.store, self._cv = store, cv
        self._pinned, self._pending, self._saving = pinned, pending, saving
        self._resident: OrderedDict[str, AgentBlocks] = OrderedDict()
        self.evictions = 0  # agents dropped from RAM (to make room, or asked to)

    def __len__(self) -> int:
        return len(self._resident)

    def get(self, agent_id: str) -> AgentBlocks | None:
        """The agent's newest cache (the caller holds ``cv``)."""
        return self._resident.get(agent_id)

    def put(self, agent_id: str, blocks: AgentBlocks) -> AgentBlocks | None:
        """Make ``blocks`` the agent's cache (the caller holds ``cv``); returns the one replaced."""
        old = self._resident.pop(agent_id, None)
        self._resident[agent_id] = blocks
        return old

    def own_cache(self, agent_id: str) -> AgentBlocks | None:
        """The agent's newest cache: resident, pending a save, else the store's (RAM, then file)."""
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
                own = self.store.load(agent_id)  # RAM tier, else the file (a restart), else None
                break
            except PoolExhaustedError:
                if not self.evict_one(keep=agent_id):  # make room for the file's blocks
                    with self._cv:
                        if self._saving():  # a resident cache becomes evictable once it is on disk
                            self._cv.wait(0.1)
                            continue
                    raise
        if own is not None:
            with self._cv:
                self._resident[agent_id] = own
        return own

    def blocks_needed(self, ids: list[int], max_tokens: int, root: int | None = None) -> int:
        """Free blocks a turn's cache will take at most: the prompt's misses plus its generated tokens."""
        per_group = -(-max_tokens // self.store.block_tokens) + 1
        return self.store.blocks_to_take(ids, root) + per_group * len(self.store.spec.groups())

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
                with self._cv:
                    if self._saving():  # a cache becomes evictable once it is on disk
                        self._cv.wait(0.1)
                        continue
                raise PoolExhaustedError(
                    f"this turn needs {need} free blocks; {self.store.free_blocks()} are free and every cached agent"
                    " is busy or not yet saved: raise total_blocks or lower max_batch"
                )

    def evict_one(self, keep: str) -> bool:
        """Drop the least recently used unpinned cache but ``keep``'s; False if there is none."""
        with self._cv:
            victim = next((a for a in self._resident if a != keep and not self._pinned(a)), None)
            if victim is None:
                return False
            dropped = self._resident.pop(victim)
            self.evictions += 1
        del dropped  # released here, outside cv (lock order: cv is never held while releasing)
        self.store.evict(victim)  # its file stays: the next turn reloads it
        return True

    def drop(self, agent_id: str) -> None:
        """Forget the agent's resident cache (the caller checked it is not pinned) and the store's RAM copy."""
        with self._cv:
            dropped = self._resident.pop(agent_id, None)
            self.evictions += 1
        del dropped  # released outside cv
        self.store.evict(agent_id)

    def clear(self) -> None:
        """Release every resident cache."""
        with self._cv:
            resident, self._resident = self._resident, OrderedDict()
        resident.clear()  # releases outside cv
