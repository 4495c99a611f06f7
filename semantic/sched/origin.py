"""Where a turn's starting cache comes from, and how many free pool bytes the turn will take.

The scheduler's worker asks once for each turn at the head of its agent's
queue, before the planner decides whether it starts::

    the agent's cache held here (resident, else pending a save)
        └─ another server published a newer one (--remote): the resident one goes, unless pinned,
           and the file is read instead
    else its file (a restart, an eviction; the store fetches a newer one from the tier first)
        └─ the pool has no room for it: the planner evicts a resident cache (or waits for a
           save) and the read is tried again; nothing can make room: the turn fails
    none (a new agent, an anonymous turn): a prefix another server published
        (a shared system prompt) is brought into the pool for the turn to hit
    unless the agent's cache was held here: a longer prefix than it and the pool give that block
        files on this disk hold (another agent's system prompt, saved before a restart) is brought in too

A cache read from its file is the turn's alone, not resident. The turn then
starts from the longest prefix its own cache or the pool covers
(``semantic.cache.reuse``). What the pool holds and what a turn takes from it
are the cache manager's to say (``semantic.cache.manager``), asked here as the
executor asks it.

Lock order, as the scheduler's: its condition is held only around the
planner, never while the store is asked (the store takes the pool's lock).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from semantic.cache.blocks import AgentBlocks
from semantic.cache.manager import CacheManager
from semantic.errors import PoolExhaustedError
from semantic.sched.planner import StepPlan, StepPlanner
from semantic.request import Request
from semantic.store import AgentCacheStore

log = logging.getLogger(__name__)


class CacheOrigin:
    """Each queued turn's starting cache and its block need, for the scheduler's worker.

    Args:
        store: the agents' files, the pool and the remote tier.
        planner: the scheduler's planner, read and changed under ``cv`` only.
        cv: the scheduler's condition.
        carry_out: how the scheduler does a plan (decides under ``cv``, evicts, waits, fails);
            given the decision, it returns the plan it carried out.
        cache: the executor's cache manager now (an executor made again after a failure has its own).
        apart: whether the executor's batches keep rows apart (``kinds.rows``): their layers hold no
            merged copy to charge.
    """

    def __init__(self, store: AgentCacheStore, planner: StepPlanner, cv: threading.Condition,
                 carry_out: Callable[[Callable[[], StepPlan]], StepPlan],
                 cache: Callable[[], CacheManager], apart: Callable[[], bool] = lambda: False):
        self.store, self.planner, self._cv, self._carry_out = store, planner, cv, carry_out
        self._cache, self._apart = cache, apart

    def find(self, request: Request) -> AgentBlocks | None:
        """The cache ``request``'s turn starts from; with none, a shared prefix is fetched into the pool.

        Args:
            request: the turn at the head of its agent's queue.

        Returns:
            The agent's newest cache (held by the scheduler, else read from its file for this turn
            alone), or None: none, or an anonymous turn.

        Raises:
            PoolExhaustedError: the file's blocks do not fit the pool and nothing can make room.
        """
        own, resident = self._own(request.agent_id, request.ids) if request.persist else (None, False)
        if own is None and self.store.remote is not None:
            # a prefix another server published (a shared system prompt): into the pool first
            self.store.prefetch(request.ids, request.salt_root)
        if not resident:  # a resident agent's pool holds whatever this disk could add
            self._from_disk(request, own)
        return own

    def _from_disk(self, request: Request, own: AgentBlocks | None) -> None:
        """Bring into the pool a longer prefix than ``own`` and the pool give when some agent's block files
        on disk hold one (a system prompt saved before a restart); a full pool skips it."""
        cached = self._cache().cached_now(request.ids, own, request.salt_root)
        try:
            self.store.load_prefix(request.ids, request.salt_root, beyond=cached)
        except PoolExhaustedError:
            log.debug("no room for a prefix from disk; the turn starts from %d tokens", cached)

    def need(self, request: Request, own: AgentBlocks | None = None) -> int:
        """Free pool bytes ``request``'s turn will take at most.

        Args:
            request: the turn to admit.
            own: the cache it starts from (:meth:`find`).

        Returns:
            The prompt's blocks the pool misses plus those its generated tokens may fill, plus the copy of
            its cache the turn holds when it cannot run in the pool's buffers (``CacheManager.turn_need``),
            in bytes.
        """
        return self._cache().turn_need(request.ids, request.max_tokens, own, request.salt_root)

    def row(self, request: Request) -> int:
        """``request``'s row in a merged batch, in bytes (``CacheManager.batch_row``)."""
        return self._cache().batch_row(len(request.ids), self._apart())

    def _own(self, agent_id: str, ids) -> tuple[AgentBlocks | None, bool]:
        """The agent's newest cache: the one held here unless another server moved on, else its file; and
        whether it was held here."""
        with self._cv:
            own = self.planner.own_cache(agent_id)
        if own is not None and self.store.remote is not None and self.store.newer_elsewhere(agent_id):
            with self._cv:  # another server moved the agent on: its file is newer than what is resident here
                stale = None if self.planner.pinned(agent_id) else self.planner.drop(agent_id)
            if stale is not None:
                own = None
            del stale  # released outside the lock
        if own is not None:
            return own, True
        while True:
            try:
                return self.store.load(agent_id, ids), False  # the file (a restart, an eviction), else None
            except PoolExhaustedError:  # room for the file's blocks, else the turn fails
                if not self._carry_out(lambda: self.planner.make_room(exclude=agent_id) or StepPlan()):
                    raise
