"""The one RAM tier: each agent's newest finished cache, kept between its turns, and the bytes they hold.

Resident bytes are the bytes of the distinct pool blocks the resident
caches reference (:class:`DistinctBytes`): a block shared by several agents
(a common system prompt) counts once. A sequence in flight is not resident:
its live cache is the executor's, bounded by the batch and admission; a cache
read from its file for a turn is that turn's until the turn finishes and
its successor is put here. So resident bytes grow only when a turn finishes.

Plain state: no locks, no threads. The scheduler's planner decides which
cache goes (``semantic.sched.planner``) and holds its lock around every call; the
AgentBlocks a call hands back are released by the caller, outside that lock.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Iterable, Iterator

from semantic.cache.blocks import AgentBlocks


class DistinctBytes:
    """Bytes of the distinct blocks of a changing set of caches (a shared block counts once)."""

    def __init__(self):
        self._refs: Counter[int] = Counter()  # id(block) -> caches of the set holding it
        self.bytes = 0

    def add(self, blocks: AgentBlocks) -> None:
        for b in blocks.unique_blocks():
            if self._refs[id(b)] == 0:
                self.bytes += b.nbytes
            self._refs[id(b)] += 1

    def remove(self, blocks: AgentBlocks) -> None:
        for b in blocks.unique_blocks():
            self._refs[id(b)] -= 1
            if self._refs[id(b)] == 0:
                del self._refs[id(b)]
                self.bytes -= b.nbytes

    @staticmethod
    def of(caches: Iterable[AgentBlocks]) -> int:
        """The same count made afresh from ``caches`` (checks a running count)."""
        unique = {id(b): b for blocks in caches for b in blocks.unique_blocks()}
        return sum(b.nbytes for b in unique.values())


class Residency:
    """Resident caches by agent, least recently used first, and their distinct bytes."""

    def __init__(self):
        self._caches: OrderedDict[str, AgentBlocks] = OrderedDict()
        self._counted = DistinctBytes()
        self.peak_bytes = 0  # the most resident bytes seen at a sample (after each scheduler pass)

    def __len__(self) -> int:
        return len(self._caches)

    def __contains__(self, agent_id: str) -> bool:
        return agent_id in self._caches

    def __iter__(self) -> Iterator[str]:
        """Agents, least recently used first."""
        return iter(list(self._caches))

    @property
    def bytes(self) -> int:
        return self._counted.bytes

    def get(self, agent_id: str) -> AgentBlocks | None:
        return self._caches.get(agent_id)

    def touch(self, agent_id: str) -> None:
        """Mark the agent's cache as just used."""
        self._caches.move_to_end(agent_id)

    def put(self, agent_id: str, blocks: AgentBlocks) -> AgentBlocks | None:
        """Make ``blocks`` the agent's cache, most recently used; returns the one it replaces."""
        old = self.pop(agent_id)
        self._caches[agent_id] = blocks
        self._counted.add(blocks)
        return old

    def pop(self, agent_id: str) -> AgentBlocks | None:
        blocks = self._caches.pop(agent_id, None)
        if blocks is not None:
            self._counted.remove(blocks)
        return blocks

    def recount(self) -> int:
        """Resident bytes counted afresh from the caches (checks the running count)."""
        return DistinctBytes.of(self._caches.values())

    def sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def clear(self) -> list[AgentBlocks]:
        """Forget every cache; the caller releases what comes back."""
        caches = list(self._caches.values())
        self._caches.clear()
        self._counted = DistinctBytes()
        return caches
