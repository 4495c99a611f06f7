"""The disk tier's budget and the cache directory's health.

The disk budget is the smaller of ``disk_budget_bytes`` and what the
filesystem leaves (our files plus the free space, less a reserve): the
effective budget in the store's stats. Over the configured budget, least
recently used files go (never the one just saved or fetched: a soft limit);
a disk that other programs filled only stops new saves, and every file
already written stays loadable.

A disk that is full, read-only or gone is the business of
``semantic.store.diskhealth``: a save it would not take raises
:class:`CacheSaveError` before anything is written, nothing is deleted to
make room, and saves are tried again after a back-off.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from semantic.store.diskhealth import DiskHealth
from semantic.store.filelayout import AgentFiles

log = logging.getLogger(__package__)  # the store's one logger: its lines keep the name they had


class DiskBudget:
    """Holds the indexed files to ``budget`` bytes, least recently used going first, and keeps the
    directory's :class:`DiskHealth` (its state for saves, and the room the filesystem leaves).

    Args:
        directory: the cache directory.
        budget: bytes of files the store may keep.
        files: the index whose files the budget holds.
        lock: the store's lock, which guards ``health`` and ``evictions``.
    """

    def __init__(self, directory: Path, budget: int, *, files: AgentFiles, lock: threading.Lock):
        self.budget = budget
        self.files = files
        self.lock = lock
        self.health = DiskHealth(directory)  # guarded by lock
        self.evictions = 0  # files deleted to hold the budget; guarded by lock

    def snapshot(self, ours: int) -> dict:
        """The directory's state for saves (``DiskHealth.snapshot``) with ``effective_budget_bytes``
        (under the lock).

        Args:
            ours: bytes of the indexed files.
        """
        disk = self.health.snapshot()  # one statvfs: the room below comes from it
        room = disk["room_bytes"]
        disk["effective_budget_bytes"] = self.budget if room is None else min(self.budget, ours + room)
        return disk

    def trim(self, keep: str) -> None:
        """Delete least recently used files until the disk tier fits its budget.

        Agents busy in another thread are skipped rather than waited for.

        Args:
            keep: the agent whose file stays whatever the budget says ("": none).
        """
        while True:
            with self.lock:
                if self.files.total_bytes() <= self.budget:
                    return
                candidates = self.files.least_recent(keep)
            for victim in candidates:
                lock = self.files.agent_lock(victim)
                if lock.acquire(blocking=False):
                    break
            else:
                return  # every other agent is busy: try again on the next save
            try:
                try:
                    evicted = self.files.evict(victim)
                except OSError as exc:  # a read-only directory: the file stays, and so does its entry
                    log.warning("cannot delete %r's cache to hold the disk budget: %s", victim, exc)
                    return
                with self.lock:
                    self.evictions += evicted
            finally:
                lock.release()
