"""The agents a cache directory holds, least recently used first: what both layouts index, name and delete alike.

Each indexed agent has an entry (its file, or its manifest and the block files it names), a version
(the ``time_ns`` of its save, a fetched copy's own, or after a startup scan its file's mtime), and a
lock that serializes the calls for it. Methods marked *(under the lock)* expect the caller to hold the
store's ``lock``; the others take it themselves, never during file I/O.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from semantic import cachefile
from semantic.cache.spec import ModelCacheSpec
from semantic.cachefile import atomic
from semantic.request import validate_agent_id
from semantic.store.quarantine import Quarantine

EXTRA_SUFFIX = ".json"  # an agent's small JSON document beside its cache file: <cache file name>.json


def file_name(agent_id: str) -> str:
    """The file name that holds ``agent_id``'s cache (never a path).

    Raises:
        InvalidAgentIdError: see :func:`request.validate_agent_id`.
    """
    validate_agent_id(agent_id)
    slug = re.sub(r"[^a-z0-9_-]+", "-", agent_id.lower()).strip("-")[:32] or "agent"
    digest = hashlib.sha256(agent_id.encode()).hexdigest()[:24]
    return f"{slug}-{digest}{cachefile.SUFFIX}"




class AgentIndex:
    """The index both layouts share.

    Args:
        directory: the cache directory (created by the layout's ``scan``).
        spec: the cache spec of everything indexed, saved and loaded.
        fingerprint: the model's, written into every file; files of other models are not indexed.
        durable: fsync what a save writes, and its directory.
        lock: the store's lock: it guards the index, the versions and the counters.
        quarantine: where files that fail their checks go.
    """

    def __init__(self, directory: Path, spec: ModelCacheSpec, fingerprint: str, *, durable: bool,
                 lock: threading.Lock, quarantine: Quarantine):
        self.dir, self.spec, self.fingerprint, self.durable = directory, spec, fingerprint, durable
        self.lock = lock
        self.quarantine = quarantine
        self.entries: OrderedDict[str, Any] = OrderedDict()  # least recently used first
        self.versions: dict[str, int] = {}  # agent -> version of what is on disk here
        self.hits = 0
        self.misses = 0
        self.foreign: list[str] = []   # files of another model or spec, left in place
        self.cleaned: list[str] = []   # leftover temporary files deleted on startup
        self.scanned = False
        self._agent_locks: dict[str, threading.Lock] = {}

    def agent_lock(self, agent_id: str) -> threading.Lock:
        """The lock that serializes calls for ``agent_id`` (held around its file I/O)."""
        with self.lock:
            return self._agent_locks.setdefault(agent_id, threading.Lock())

    def stamp(self, agent_id: str, entry, version: int | None) -> int:
        """Index ``entry`` as the agent's, most recently used, and record its version (None: now) (under the lock)."""
        self.entries[agent_id] = entry
        self.entries.move_to_end(agent_id)
        version = self.versions[agent_id] = time.time_ns() if version is None else version
        return version

    def get(self, agent_id: str):
        """The agent's entry, or None (under the lock)."""
        return self.entries.get(agent_id)

    def version(self, agent_id: str) -> int | None:
        """The version of what is on disk here for the agent, or None if it never had any (under the lock)."""
        return self.versions.get(agent_id)

    def agents(self) -> list[str]:
        """Ids of the indexed agents, sorted (under the lock)."""
        return sorted(self.entries)

    def count(self) -> int:
        """How many agents are indexed (under the lock)."""
        return len(self.entries)

    def least_recent(self, keep: str) -> list[str]:
        """The indexed agents but ``keep``, least recently used first (under the lock)."""
        return [a for a in self.entries if a != keep]

    def touched(self, agent_id: str) -> None:
        """A load hit the agent: most recently used now (takes the lock)."""
        with self.lock:
            self.hits += 1
            if agent_id in self.entries:
                self.entries.move_to_end(agent_id)

    def forget(self, agent_id: str) -> None:
        """Drop the agent from the index (its file is gone or refused), counting a miss."""
        with self.lock:
            self.pop(agent_id)
            self.misses += 1

    def refuse(self, agent_id: str, path: Path, reason: str) -> None:
        """The agent's file failed its checks: forget the agent and set the file aside (``quarantine``)."""
        self.forget(agent_id)
        self.quarantine.set_aside(path, reason)

    def pop(self, agent_id: str):
        """Remove the agent's entry, its version kept (under the lock); each layout adds its own bookkeeping."""
        return self.entries.pop(agent_id, None)


def delete(path) -> None:
    """Delete an agent's file (a cache file or a manifest), then the extra document a cache file may keep
    beside it (a read-only directory keeps that).

    Raises:
        OSError: the file could not be deleted (its extra document is left too).
    """
    atomic.unlink_quietly(path)
    with contextlib.suppress(OSError):
        atomic.unlink_quietly(str(path) + EXTRA_SUFFIX)
