"""The agents' cache files in one directory, and their index, least recently used first.

Agent ids are mapped to file names, never used as paths: ``<slug>-<sha256
prefix>.safetensors``, where the slug keeps only ``[a-z0-9_-]`` of the id for
people reading the directory and the digest keeps distinct ids apart (also
on case-insensitive file systems). The id itself is stored in the file. Any
string of 1 to 256 characters without control characters is an id; others
raise :class:`InvalidAgentIdError`. Beside a cache file an agent may keep a
small JSON document (``<cache file name>.json``), deleted with it.

On startup the directory is scanned: temporary files that a dead process
left are deleted, files that fail their header check are quarantined
(``semantic.store.quarantine``), files of another model or spec are skipped
(left in place), and the rest are indexed, least recently used first. A
directory that cannot be created or listed raises OSError; the scan runs
again once it is usable. Each indexed agent also has a version: the
``time_ns`` of its save, or the version of a copy fetched from elsewhere, or
(after a scan) the file's mtime.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from semantic import cachefile
from semantic.cache.blocks import AgentBlocks
from semantic.cachefile import atomic
from semantic.errors import CacheCorruptError, CacheMismatchError, InvalidAgentIdError
from semantic.cache.pool import BlockPool
from semantic.store.agentindex import EXTRA_SUFFIX, AgentIndex, delete, file_name

log = logging.getLogger(__package__)  # the store's one logger: its lines keep the name they had

@dataclass(slots=True)
class OnDisk:
    """One indexed cache file."""

    path: Path
    nbytes: int

    @property
    def written(self) -> int:
        """Bytes the save that made it wrote: all of it."""
        return self.nbytes


class AgentFiles(AgentIndex):
    """One cache file per agent in ``directory``, indexed least recently used first, for one model and spec.

    Args: as :class:`AgentIndex` (``directory`` holds one file per agent).
    """

    def put(self, agent_id: str, entry: OnDisk, version: int | None = None) -> int:
        """Index ``entry`` as the agent's file, most recently used (under the lock).

        Args:
            version: the file's version; None: now (``time.time_ns``), for a file just saved.

        Returns:
            The version recorded.
        """
        return self.stamp(agent_id, entry, version)

    def total_bytes(self) -> int:
        """Bytes of the indexed files (under the lock)."""
        return sum(e.nbytes for e in self.entries.values())

    # ------------------------------------------------------------ the files

    def write(self, agent_id: str, blocks: AgentBlocks, prepared: cachefile.PreparedSave,
              bytes_out: Callable[[], None] = lambda: None) -> OnDisk:
        """Write the agent's cache file (crash-safe; durable if the store is); not indexed yet. ``prepared``
        lets go of its views and ``bytes_out`` is called once the file is written (as the block layout's).

        Returns:
            The file (its size is also what the save wrote).

        Raises:
            OSError: the directory did not take it (nothing written).
        """
        path = self.dir / file_name(agent_id)
        info = cachefile.save(
            path, blocks, model_fingerprint=self.fingerprint, agent_id=agent_id, durable=self.durable,
            prepared=prepared,
        )
        prepared.release()
        bytes_out()
        return OnDisk(path, info.nbytes)

    def bytes_to_write(self, blocks: AgentBlocks, prepared: cachefile.PreparedSave) -> int:
        """About how many bytes a save of ``blocks`` writes: the whole file (its header adds a few KiB)."""
        return prepared.nbytes

    def collect(self) -> int:
        """Nothing to collect: each file is one agent's."""
        return 0

    def evict(self, agent_id: str) -> bool:
        """Delete the agent's file and forget it; False when it was not indexed.

        Raises:
            OSError: the file could not be deleted (it stays indexed).
        """
        with self.lock:
            entry = self.entries.get(agent_id)
        if entry is None:
            return False
        delete(entry.path)
        with self.lock:
            self.entries.pop(agent_id, None)
        return True

    def shared_bytes(self) -> tuple[int, int]:
        """Bytes shared between agents (none: one file each) and bytes of one agent only (under the lock)."""
        return 0, self.total_bytes()

    def tokens(self, agent_id: str) -> int | None:
        """How many tokens the agent's file holds, or None (not indexed, unreadable)."""
        with self.lock:
            entry = self.entries.get(agent_id)
        try:
            return None if entry is None else cachefile.read_header(entry.path).total_tokens
        except (OSError, CacheCorruptError):
            return None

    def adopt(self, agent_id: str, data: bytes) -> Path:
        """Make ``data`` (a cache file from elsewhere) the agent's file: written aside, its header checked,
        then renamed over the old one; not indexed yet.

        Returns:
            The file's path.

        Raises:
            CacheCorruptError, CacheMismatchError: the bytes are no file of this model, spec and agent.
            OSError: the directory did not take them.
        """
        path = self.dir / file_name(agent_id)
        tmp = atomic.temp_name(path)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            info = cachefile.read_header(tmp)
            if not self._ours(info) or info.agent_id != agent_id:
                raise CacheMismatchError(f"the remote cache of {agent_id!r} is another model's, spec's or agent's")
            os.replace(tmp, path)
        except (CacheCorruptError, CacheMismatchError):
            atomic.unlink_quietly(tmp)
            raise
        except OSError:
            with contextlib.suppress(OSError):
                atomic.unlink_quietly(tmp)
            raise
        return path

    def load(self, agent_id: str, pool: BlockPool, pool_lock: threading.RLock,
             for_ids: Sequence[int] | None = None) -> AgentBlocks | None:
        """The agent's indexed file read into ``pool`` (the caller holds the agent's lock), or None.
        ``for_ids`` is ignored: this layout holds no snapshots.

        A file that fails verification is quarantined and forgotten; each None counts a miss.

        Raises:
            PoolExhaustedError: the pool has no room for the file's blocks (the file stays).
        """
        with self.lock:
            entry = self.entries.get(agent_id)
            if entry is None:
                self.misses += 1
                return None
        blocks = self._read(agent_id, entry, pool, pool_lock)
        if blocks is None:
            return None
        self.touched(agent_id)
        try:
            os.utime(entry.path)  # recency survives a restart
        except OSError:
            pass
        return blocks

    def save_extra(self, agent_id: str, doc: dict) -> bool:
        """Keep a small JSON document beside the agent's cache file; False if it could not be written."""
        path = self.dir / (file_name(agent_id) + EXTRA_SUFFIX)
        tmp = atomic.temp_name(path)
        try:
            with open(tmp, "w") as f:
                json.dump(doc, f, separators=(",", ":"))
            os.replace(tmp, path)
            return True
        except (OSError, TypeError, ValueError) as exc:  # a full or read-only disk: the store's saves say so
            log.debug("agent %r: extra document not written: %s", agent_id, exc)
            with contextlib.suppress(OSError):
                atomic.unlink_quietly(tmp)
            return False

    def load_extra(self, agent_id: str) -> dict | None:
        """The document :meth:`save_extra` kept for the agent, or None (none, unreadable, not a JSON object)."""
        try:
            doc = json.loads((self.dir / (file_name(agent_id) + EXTRA_SUFFIX)).read_text())
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def scan(self) -> None:
        """Index the directory's files (raises OSError when it cannot be created or listed)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cleaned.extend(atomic.remove_abandoned(self.dir))  # dead writers' temporary files
        found = []
        for path in sorted(self.dir.iterdir()):
            if path.name.endswith(cachefile.SUFFIX + EXTRA_SUFFIX) and not path.with_suffix("").exists():
                with contextlib.suppress(OSError):  # its cache file is gone (a read-only directory keeps it)
                    atomic.unlink_quietly(path)
            if not path.is_file() or not path.name.endswith(cachefile.SUFFIX):
                continue
            try:
                info = cachefile.read_header(path)
            except CacheCorruptError as exc:
                self.quarantine.set_aside(path, exc.reason)
                continue
            except OSError as exc:
                log.warning("skipping unreadable cache file %s: %s", path, exc)
                continue
            if not self._ours(info):
                self.foreign.append(str(path))
                continue
            try:
                expected = file_name(info.agent_id)
            except InvalidAgentIdError:
                expected = None
            if expected != path.name:
                self.quarantine.set_aside(path, f"file name does not match its agent id {info.agent_id!r}")
                continue
            found.append((path.stat().st_mtime_ns, info.agent_id, OnDisk(path, info.nbytes)))
        with self.lock:
            # newest first, each put in front: least recently used first, ahead of what this process saved
            for mtime_ns, agent_id, entry in sorted(found, key=lambda x: (x[0], x[1]), reverse=True):
                if agent_id not in self.entries:
                    self.entries[agent_id] = entry
                    self.entries.move_to_end(agent_id, last=False)
                    # written at or after its version was stamped: a remote copy of the same save is not newer
                    self.versions.setdefault(agent_id, mtime_ns)
        self.scanned = True

    def _ours(self, info: cachefile.CacheFileInfo) -> bool:
        return info.model_fingerprint == self.fingerprint and info.spec == self.spec

    def _read(self, agent_id: str, entry: OnDisk, pool: BlockPool, pool_lock: threading.RLock) -> AgentBlocks | None:
        try:
            owner = cachefile.read_header(entry.path).agent_id
            if owner != agent_id:  # replaced behind our back by another agent's file
                raise CacheCorruptError(entry.path, f"file name does not match its agent id {owner!r}")
            return cachefile.load(entry.path, pool, model_fingerprint=self.fingerprint, lock=pool_lock)
        except CacheCorruptError as exc:
            self.refuse(agent_id, entry.path, exc.reason)
            return None
        except (CacheMismatchError, FileNotFoundError) as exc:
            # replaced by another model's file, or removed behind our back
            log.warning("agent %r: cannot load %s: %s", agent_id, entry.path, exc)
            self.forget(agent_id)
            return None
        except OSError as exc:  # unreadable now (permissions, I/O): a miss; the file may read again later
            log.warning("agent %r: cannot read %s: %s", agent_id, entry.path, exc)
            with self.lock:
                self.misses += 1
            return None
