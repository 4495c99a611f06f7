"""The scheduler's resident caches as any thread asks about them.

Agents' caches between turns live in the planner's residency
(``semantic.sched.residency``), changed by the worker under the scheduler's
condition; these queries read it under the same condition, from any thread.
A cache dropped here is released after the condition is let go: releasing
takes the pool's lock, and the scheduler's condition is never held while
the pool's lock is taken.
"""

from __future__ import annotations

import threading

from semantic.cache.blocks import AgentBlocks
from semantic.sched.planner import StepPlanner


class ResidentView:
    """What :class:`~semantic.sched.scheduler.ConcurrentScheduler` holds in RAM: read, and evicted on request.

    A base of the scheduler: it reads the scheduler's ``planner`` under its ``_cv``.
    """

    planner: StepPlanner
    _cv: threading.Condition

    def resident_bytes(self, recount: bool = False) -> int:
        """Resident bytes now.

        Args:
            recount: count them afresh from the resident caches instead of the running count.

        Returns:
            The distinct pool bytes of the resident caches.
        """
        with self._cv:
            r = self.planner.residency
            return r.recount() if recount else r.bytes

    def resident_agents(self) -> list[str]:
        """Agents whose cache is resident now, least recently used first."""
        with self._cv:
            return list(self.planner.residency)

    def evict(self, agent_id: str) -> bool:
        """Drop ``agent_id``'s cache from RAM; its file stays, and its next turn reloads it.

        Args:
            agent_id: the agent whose cache goes.

        Returns:
            False (and drops nothing) while the agent has a turn queued or in flight, or its cache is not on
            disk yet; else True.
        """
        with self._cv:
            if self.planner.pinned(agent_id) or self.planner.holds(agent_id):
                return False
            dropped = self.planner.drop(agent_id)
        del dropped  # released outside the lock
        return True

    def holds(self, agent_id: str) -> bool:
        """Whether ``agent_id`` has a turn queued or in flight (its cache is resident once it finishes)."""
        with self._cv:
            return self.planner.holds(agent_id)

    def resident_cache(self, agent_id: str) -> AgentBlocks | None:
        """The newest cache the scheduler holds for ``agent_id`` (read only; do not release)."""
        with self._cv:
            return self.planner.residency.get(agent_id)
