"""The scheduler's saver thread: finished caches written to the store behind the worker.

The worker prepares each save (``cachefile.prepare_save``, the MLX part) and
queues it in the planner's :class:`~semantic.sched.saves.SaveState`; this thread
takes the oldest, writes its bytes and reports back, so MLX keeps computing.
A failed save is counted (the store logs one line per kind of failure: a
full disk, a read-only or vanished directory); the cache stays resident
(``unsaved`` until a later save of the agent succeeds: evicted only as the
last resort, counted as lost, ``semantic.sched.planner``) and the agent's next
finished turn saves again.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from semantic.errors import CacheSaveError
from semantic.sched.saves import SaveState
from semantic.store import AgentCacheStore

log = logging.getLogger(__name__)


class WriteBehind:
    """The thread that writes what ``saves`` holds.

    Args:
        store: where the caches are saved.
        saves: the save state, guarded by ``cv``.
        cv: the scheduler's condition; notified after every save.
        finished: whether nothing will queue a save any more (checked under
            ``cv``); this thread then writes what is pending, and stops.
    """

    def __init__(self, store: AgentCacheStore, saves: SaveState, cv: threading.Condition, finished: Callable[[], bool]):
        self.store, self.saves, self._cv, self._finished = store, saves, cv, finished
        self._thread = threading.Thread(target=self._loop, name="semantic-saver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None) -> None:
        self._thread.join(timeout)

    def _out(self, agent_id: str) -> None:
        """The save's bytes are in the files: a turn that waits to write into its buffers may start."""
        with self._cv:
            self.saves.bytes_out(agent_id)
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while (job := self.saves.take()) is None:
                    if self._finished():
                        return
                    self._cv.wait(0.5)
            agent_id, (blocks, prepared) = job
            try:
                self.store.save(agent_id, blocks, prepared, lambda: self._out(agent_id))
                ok = True
            except CacheSaveError:  # the store logged its kind once; the cache stays resident
                ok = False
            except Exception:  # unexpected: the cache stays resident; the next finish saves again
                log.exception("agent %r: write-behind save failed", agent_id)
                ok = False
            del blocks, prepared, job
            with self._cv:
                self.saves.done(agent_id, ok)
                self._cv.notify_all()
