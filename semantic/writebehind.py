"""The scheduler's saver thread: finished caches written to the store behind the worker.

The worker prepares each save (``cachefile.prepare``, the MLX part) and
queues it here; this thread only writes bytes, so MLX keeps computing.
Pending saves are bounded by the agents that have one: a newer save of an
agent replaces its older pending one. A failed save is counted and logged;
the cache stays resident (``unsaved`` until a later save of the agent
succeeds, so neither the pool nor the RAM budget evicts it) and the agent's
next finished turn saves again.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Callable

from semantic import cachefile
from semantic.blocks import AgentBlocks
from semantic.store import AgentCacheStore

log = logging.getLogger(__name__)


class WriteBehind:
    """Pending saves, oldest first, and the thread that writes them.

    Args:
        store: where the caches are saved.
        cv: the scheduler's condition; it guards the pending map and is
            notified after every save.
        closing: whether the scheduler is closing (checked under ``cv``).
        worker: the thread that queues saves; once it has stopped while
            closing, this thread writes what is pending, then stops.
    """

    def __init__(
        self, store: AgentCacheStore, cv: threading.Condition, closing: Callable[[], bool], worker: threading.Thread
    ):
        self.store, self._cv, self._closing, self._worker = store, cv, closing, worker
        self._pending: OrderedDict[str, tuple[AgentBlocks, cachefile.PreparedSave]] = OrderedDict()
        self._saving: str | None = None
        self._failed: set[str] = set()  # agents whose newest save failed
        self.saves = self.errors = 0
        self._thread = threading.Thread(target=self._loop, name="semantic-saver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None) -> None:
        self._thread.join(timeout)

    # the caller holds cv for these

    def __len__(self) -> int:
        return len(self._pending)

    def outstanding(self) -> int:
        """Saves not yet on disk: pending, plus the one being written."""
        return len(self._pending) + (self._saving is not None)

    @property
    def busy(self) -> bool:
        """Whether a save is pending or being written."""
        return bool(self._pending) or self._saving is not None

    def holds(self, agent_id: str) -> bool:
        """Whether the agent has a save pending or being written."""
        return agent_id in self._pending or agent_id == self._saving

    def unsaved(self, agent_id: str) -> bool:
        """Whether the agent's newest cache is not on disk: its save is pending, being written, or failed."""
        return self.holds(agent_id) or agent_id in self._failed

    def pending(self, agent_id: str) -> AgentBlocks | None:
        """The cache the agent's pending save will write, if any."""
        entry = self._pending.get(agent_id)
        return entry[0] if entry is not None else None

    def put(self, agent_id: str, blocks: AgentBlocks, prepared: cachefile.PreparedSave):
        """Queue a save; returns the older pending one it replaces (release it outside ``cv``)."""
        replaced = self._pending.pop(agent_id, None)
        self._pending[agent_id] = (blocks, prepared)
        return replaced

    # the thread

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not (self._closing() and not self._worker.is_alive()):
                    self._cv.wait(0.5 if self._closing() else None)
                if not self._pending:
                    return
                agent_id, (blocks, prepared) = self._pending.popitem(last=False)
                self._saving = agent_id
            try:
                self.store.save(agent_id, blocks, prepared, keep_in_ram=False)  # the scheduler keeps it resident
                ok = True
            except Exception:  # the cache stays resident; the next finish saves again
                log.exception("agent %r: write-behind save failed", agent_id)
                ok = False
            del blocks, prepared
            with self._cv:
                self.saves += ok
                self.errors += not ok
                if ok:
                    self._failed.discard(agent_id)
                else:
                    self._failed.add(agent_id)
                self._saving = None
                self._cv.notify_all()
