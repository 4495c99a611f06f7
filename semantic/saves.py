"""Which agents' caches are on disk: saves pending, the one being written, the ones that failed.

One object, held directly by the planner (a cache not on disk is never
evicted) and by the saver thread (``writebehind``), which takes the oldest
pending save, writes it and reports back. Pending saves are bounded by the
agents that have one: a newer save of an agent replaces its older pending
one. A failed save leaves the agent ``unsaved`` until a later save of it
succeeds. Plain state: the scheduler's lock guards every call.
"""

from __future__ import annotations

from collections import OrderedDict

from semantic import cachefile
from semantic.blocks import AgentBlocks

Pending = tuple[AgentBlocks, cachefile.PreparedSave]


class SaveState:
    """Pending saves, oldest first, and what became of the ones written."""

    def __init__(self):
        self._pending: OrderedDict[str, Pending] = OrderedDict()
        self.saving: str | None = None  # the agent whose save is being written
        self._failed: set[str] = set()  # agents whose newest save failed
        self.saves = self.errors = 0

    def put(self, agent_id: str, blocks: AgentBlocks, prepared: cachefile.PreparedSave) -> Pending | None:
        """Queue a save; returns the older pending one it replaces (the caller releases it)."""
        replaced = self._pending.pop(agent_id, None)
        self._pending[agent_id] = (blocks, prepared)
        return replaced

    def take(self) -> tuple[str, Pending] | None:
        """The oldest pending save, now being written; None if there is none."""
        if not self._pending:
            return None
        agent_id, entry = self._pending.popitem(last=False)
        self.saving = agent_id
        return agent_id, entry

    def done(self, agent_id: str, ok: bool) -> None:
        """The save :meth:`take` handed out was written (``ok``) or failed."""
        assert self.saving == agent_id, (self.saving, agent_id)
        self.saving = None
        if ok:
            self.saves += 1
            self._failed.discard(agent_id)
        else:
            self.errors += 1
            self._failed.add(agent_id)

    @property
    def busy(self) -> bool:
        """Whether a save is pending or being written."""
        return bool(self._pending) or self.saving is not None

    def outstanding(self) -> int:
        """Saves not yet on disk: pending, plus the one being written."""
        return len(self._pending) + (self.saving is not None)

    def holds(self, agent_id: str) -> bool:
        """Whether the agent has a save pending or being written."""
        return agent_id in self._pending or agent_id == self.saving

    def unsaved(self, agent_id: str) -> bool:
        """Whether the agent's newest cache is not on disk: its save is pending, being written, or failed."""
        return self.holds(agent_id) or agent_id in self._failed

    def pending(self, agent_id: str) -> AgentBlocks | None:
        """The cache the agent's pending save will write, if any."""
        entry = self._pending.get(agent_id)
        return entry[0] if entry is not None else None
