"""Which agents' caches are on disk: saves pending, the one being written, the ones that failed.

One object, held directly by the planner (a cache not on disk is never
evicted) and by the saver thread (``writebehind``), which takes the oldest
pending save, writes it and reports back. Pending saves are bounded by the
agents that have one: a newer save of an agent replaces its older pending
one. A failed save leaves the agent ``unsaved`` until a later save of it
succeeds. Each save has a number, so a turn can ask what became of its own
(:meth:`SaveState.outcome`). Plain state: the scheduler's lock guards every call.

A save holds views of the pool's buffers until its bytes are in the files
(``cachefile.PreparedSave.release``): until then the agent's next turn, which
writes into that buffer, waits (:meth:`SaveState.reading`), and the saver takes
the saves such turns wait for first (``wanted``).
"""

from __future__ import annotations

from collections import OrderedDict

from semantic import cachefile
from semantic.cache.blocks import AgentBlocks
from semantic.store import PREFIX

Pending = tuple[AgentBlocks, cachefile.PreparedSave]

SAVED, PENDING, FAILED = "saved", "pending", "failed"  # what became of a turn's save
WRITTEN_KEPT = 65536  # agents whose last save's outcome is remembered (a turn asks right after its save)


class SaveState:
    """Pending saves, oldest first, and what became of the ones written."""

    def __init__(self):
        self._pending: OrderedDict[str, Pending] = OrderedDict()
        self._numbers: dict[str, int] = {}  # agent -> the number of its newest save queued
        self.saving: str | None = None  # the agent whose save is being written
        self._saving_number = 0
        self._saving_out = False  # its bytes are in the files: it holds no view of the pool any more
        self.wanted: set[str] = set()  # agents whose turns wait for their saves' bytes: taken first
        self._failed: set[str] = set()  # agents whose newest save failed
        self._written: OrderedDict[str, tuple[int, bool]] = OrderedDict()  # agent -> (number, ok) of its newest save done
        self._next = 0
        self.saves = self.errors = 0
        self.prefixes = 0  # prefix entries written
        self.lost = 0  # caches dropped from RAM unsaved (``semantic.sched.planner``): their turns are not on disk

    def put(self, agent_id: str, blocks: AgentBlocks, prepared: cachefile.PreparedSave) -> tuple[int, Pending | None]:
        """Queue a save: its number, and the older pending one it replaces (the caller releases it)."""
        replaced = self._pending.pop(agent_id, None)
        self._pending[agent_id] = (blocks, prepared)
        self._next += 1
        self._numbers[agent_id] = self._next
        return self._next, replaced

    def take(self) -> tuple[str, Pending] | None:
        """The oldest pending save, now being written; None if there is none."""
        if not self._pending:
            return None
        first = next((a for a in self._pending if a in self.wanted), None)
        if first is None:
            agent_id, entry = self._pending.popitem(last=False)
        else:
            agent_id, entry = first, self._pending.pop(first)
        self.saving, self._saving_number, self._saving_out = agent_id, self._numbers[agent_id], False
        return agent_id, entry

    def bytes_out(self, agent_id: str) -> None:
        """The save being written has its bytes in the files (its views are gone); durability comes next."""
        assert self.saving == agent_id, (self.saving, agent_id)
        self._saving_out = True
        self.wanted.discard(agent_id)

    def reading(self, agent_id: str) -> bool:
        """Whether a save of the agent still holds views of its buffers: pending, or being written and not
        yet out (:meth:`bytes_out`)."""
        return agent_id in self._pending or (agent_id == self.saving and not self._saving_out)

    def done(self, agent_id: str, ok: bool) -> None:
        """The save :meth:`take` handed out was written (``ok``) or failed."""
        assert self.saving == agent_id, (self.saving, agent_id)
        self._written[agent_id] = (self._saving_number, ok)
        self._written.move_to_end(agent_id)
        while len(self._written) > WRITTEN_KEPT:
            self._written.popitem(last=False)
        if agent_id not in self._pending:
            del self._numbers[agent_id]
            self.wanted.discard(agent_id)
        self.saving = None
        if agent_id.startswith(PREFIX):  # a prefix kept apart (``Scheduler._keep_prefix``), no agent's turn
            self.prefixes += ok
            return
        if ok:
            self.saves += 1
            self._failed.discard(agent_id)
        else:
            self.errors += 1
            self._failed.add(agent_id)

    def outcome(self, agent_id: str, number: int) -> str:
        """What became of save ``number`` of the agent: SAVED or FAILED once it, or a newer save that replaced
        it (the same history and more), was written; PENDING while one is queued or being written."""
        written = self._written.get(agent_id)
        if number > 0 and written is not None and written[0] >= number:
            return SAVED if written[1] else FAILED
        return PENDING if number > 0 and self.holds(agent_id) else FAILED

    def forget(self, agent_id: str) -> None:
        """The agent's unsaved cache was dropped (counted as lost): it is no longer pinned as unsaved."""
        self._failed.discard(agent_id)
        self.lost += 1

    def failed(self, agent_id: str) -> bool:
        """Whether the agent's newest save failed and none is pending."""
        return agent_id in self._failed and not self.holds(agent_id)

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
