"""Agents' caches kept across restarts: one file per agent, under a disk budget.

``save`` writes the agent's cache file (``cachefile``, crash-safe) before
it returns; ``load`` reads it back into the pool (verified), else ``None``.
So every saved cache survives a crash. The caches kept in RAM between turns
are the scheduler's (``semantic.residency``, under its RAM budget): this
store holds no blocks of its own::

    save(a) ──► file a (fsynced)
    load(a) ──► file? ──► blocks in the pool (the caller's), else None
    disk over budget  ──► delete least recently used files (never the one just saved)
    disk full, read-only or gone ──► CacheSaveError (``semantic.diskhealth``): nothing deleted, retried later

Agent ids are mapped to file names, never used as paths: ``<slug>-<sha256
prefix>.safetensors``, where the slug keeps only ``[a-z0-9_-]`` of the id for
people reading the directory and the digest keeps distinct ids apart (also
on case-insensitive file systems). The id itself is stored in the file. Any
string of 1 to 256 characters without control characters is an id; others
raise :class:`InvalidAgentIdError`.

On startup the store scans its directory: it deletes temporary files that a
dead process left, moves files that fail their header check to
``quarantine/`` (see :attr:`AgentCacheStore.quarantined`), skips files of
another model or spec, and indexes the rest, least recently used first. A
directory that cannot be created or written is no error: the store serves
what it can read, saves fail with :class:`CacheSaveError` (tried again after
a back-off), and the scan runs once the directory is usable.

The disk budget is the smaller of ``disk_budget_bytes`` and what the
filesystem leaves (our files plus the free space, less a reserve):
:meth:`AgentCacheStore.effective_budget`. Over the configured budget, least
recently used files go; a disk that other programs filled only stops new
saves, and every file already written stays loadable.

Threads: calls for different agents run concurrently (file reads and writes
happen outside every shared lock); calls for the same agent are serialized.
Every use the store makes of ``pool`` holds :attr:`AgentCacheStore.pool_lock`,
and so do the releases of the AgentBlocks it returns; anything else that
uses the same pool from another thread must hold it too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

from semantic import blockplan, cachefile
from semantic.cachefile import atomic
from semantic.blocks import AgentBlocks
from semantic.diskhealth import DiskHealth
from semantic.errors import (
    CacheCorruptError,
    CacheMismatchError,
    CacheSaveError,
    InvalidAgentIdError,
    PoolExhaustedError,
)
from semantic.pool import BlockPool
from semantic.request import validate_agent_id
from semantic.spec import ModelCacheSpec
from semantic.store.quarantine import QUARANTINE_DIR, Quarantine, Quarantined

log = logging.getLogger(__name__)

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


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters since the store opened, and what it holds now (``disk_bytes``: the indexed files)."""

    disk_hits: int
    misses: int
    disk_evictions: int
    disk_agents: int
    disk_bytes: int
    quarantined: int
    disk: dict | None = None  # the directory's state for saves (``DiskHealth.snapshot``) and the effective budget


@dataclass(slots=True)
class _OnDisk:
    path: Path
    nbytes: int


class AgentCacheStore:
    """Agents' caches as files in ``cache_dir`` (least recently used go first
    over ``disk_budget_bytes``), for one model and spec.

    Args:
        cache_dir: created if missing; holds one file per agent.
        spec: the cache spec every saved and loaded cache must have.
        model_fingerprint: written into each file; files of other models
            are left alone and not indexed.
        disk_budget_bytes: bytes of files the store may keep (a soft
            limit: the file just saved is never deleted to meet it).
        pool: the block pool loaded caches go into (the engine's pool).
        durable: fsync each file and the directory on save.
        remote: a tier shared with other servers of the model: a ``redis://`` URL, or a
            :class:`semantic.remote.RemoteTier` (for its options, such as a budget); None: this machine only.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike,
        spec: ModelCacheSpec,
        model_fingerprint: str,
        disk_budget_bytes: int,
        *,
        pool: BlockPool,
        durable: bool = True,
        remote=None,
    ):
        if not isinstance(model_fingerprint, str) or not model_fingerprint:
            raise ValueError(f"model_fingerprint must be a non-empty string, got {model_fingerprint!r}")
        if disk_budget_bytes < 0:
            raise ValueError(f"budgets must be >= 0 bytes, got a disk budget of {disk_budget_bytes}")
        spec.require_same(pool.spec, "the pool")
        self.dir = Path(cache_dir)
        self.spec, self.fingerprint, self.pool, self.durable = spec, model_fingerprint, pool, durable
        self.disk_budget = disk_budget_bytes
        self.pool_lock = threading.RLock()
        self._lock = threading.Lock()  # the index and counters; never held during file I/O
        self._quarantine = Quarantine(self.dir, self._lock)
        self._agent_locks: dict[str, threading.Lock] = {}
        self._disk: OrderedDict[str, _OnDisk] = OrderedDict()
        self._counts = Counter()
        self.foreign: list[str] = []   # files of another model or spec, left in place
        self.cleaned: list[str] = []   # leftover temporary files deleted on startup
        self.health = DiskHealth(self.dir)  # guarded by _lock
        if isinstance(remote, str):
            from semantic.remote import RemoteTier

            remote = RemoteTier(remote, model_fingerprint)
        self.remote = remote  # a RemoteTier shared with other servers (``semantic.remote``), or None
        self._versions: dict[str, int] = {}  # agent -> version of its local file (time_ns of its save)
        self._scanned = False
        try:
            self._scan()
        except OSError as exc:  # served from RAM until the directory can be used (the next save tries again)
            with self._lock:
                self.health.failed(exc)

    # ------------------------------------------------------------ public

    def save(self, agent_id: str, blocks: AgentBlocks, prepared: cachefile.PreparedSave | None = None) -> None:
        """Write ``agent_id``'s cache file (durable unless the store is not).

        The caller keeps (and may release) ``blocks``: the store keeps no
        reference. ``prepared`` (``cachefile.prepare_save``) lets a write-behind
        thread save without any MLX work of its own.
        """
        name = file_name(agent_id)
        self.spec.require_same(blocks.spec, "these blocks")
        self._check_live(blocks)  # before any write: blocks of another pool are refused
        if prepared is None:
            prepared = cachefile.prepare_save(blocks)
        with self._agent_lock(agent_id):
            with self._lock:
                self.health.check(prepared.nbytes)  # raises while backing off or when the disk has no room
            try:
                if not self._scanned:
                    self._scan()  # the directory is usable again (or for the first time): index what it holds
                path = self.dir / name
                info = cachefile.save(
                    path, blocks, model_fingerprint=self.fingerprint, agent_id=agent_id, durable=self.durable,
                    prepared=prepared,
                )
            except OSError as exc:
                with self._lock:
                    err = self.health.failed(exc)
                    if err.kind == "missing":
                        self._scanned = False  # the next try makes the directory again and indexes it
                raise err from None
            with self._lock:
                self.health.ok()
                self._disk[agent_id] = _OnDisk(path, info.nbytes)
                self._disk.move_to_end(agent_id)
                version = self._versions[agent_id] = time.time_ns()
            if self.remote is not None:  # behind this call: read and sent by its thread
                chain = blockplan.chain_keys(blocks.token_ids, self.pool.block_tokens, blocks.salt_root)
                self.remote.publish(agent_id, path, version, chain)
        self._disk_trim(keep=agent_id)

    def load(self, agent_id: str) -> AgentBlocks | None:
        """``agent_id``'s cache read from its file into the pool (a new reference the caller owns), or None.

        A file that fails verification is quarantined and reported as a miss.

        Raises:
            PoolExhaustedError: the pool has no room for the file's blocks
                (the file stays; make room and load again).
        """
        validate_agent_id(agent_id)
        with self._agent_lock(agent_id):
            fetched = self._fetch_newer(agent_id) if self.remote is not None else None
            blocks = self._load_indexed(agent_id)
            if blocks is None and fetched is not None:  # what another server published failed its checks here
                self.remote.drop(agent_id, fetched)
        if fetched is not None:  # a file came from elsewhere: the disk tier holds to its budget as on a save
            self._disk_trim(keep=agent_id)
        return blocks

    def _load_indexed(self, agent_id: str) -> AgentBlocks | None:
        """The agent's indexed file loaded (under its lock), or None: none, or it failed its checks."""
        with self._lock:
            entry = self._disk.get(agent_id)
            if entry is None:
                self._counts["misses"] += 1
                return None
        blocks = self._load_file(agent_id, entry)
        if blocks is None:
            return None
        with self._lock:
            self._counts["disk_hits"] += 1
            if agent_id in self._disk:
                self._disk.move_to_end(agent_id)
        try:
            os.utime(entry.path)  # recency survives a restart
        except OSError:
            pass
        return blocks

    def prefetch(self, token_ids, salt_root: int | None = None) -> int:
        """Bring into the pool the leading full blocks of ``token_ids`` that it lacks and another server
        published (the holder's file, fetched, kept on local disk and loaded; its blocks stay pooled for
        the turn to hit). Returns the blocks gained; 0 without a remote tier or when nothing helps."""
        if self.remote is None:
            return 0
        bt = self.pool.block_tokens
        chain = blockplan.chain_keys(token_ids, bt, salt_root)
        with self.pool_lock:
            plan = blockplan.plan_blocks(self.pool, self.spec, token_ids, chain, salt_root=salt_root)
        have = len(chain)  # leading full blocks every group that holds them (global layers) has pooled
        for group in {p.group for p in plan.blocks}:
            spans = [p for p in plan.blocks if p.group == group]
            if spans and spans[0].start == 0:
                hits = 0
                for p in spans:
                    if p.hit is None or p.end - p.start != bt:
                        break
                    hits += 1
                have = min(have, hits)
        if have == len(chain):
            return 0
        found = self.remote.holder(chain[have:])
        if found is None:
            return 0
        n, holder = found
        try:
            validate_agent_id(holder)
            blocks = self.load(holder)
        except (InvalidAgentIdError, PoolExhaustedError) as exc:
            log.info("prefix of %d blocks held by %r not loaded: %s", n, holder, exc)
            return 0
        if blocks is None:
            return 0
        with self.pool_lock:
            blocks.release()  # its keyed blocks stay in the pool's free queue, hittable until recycled
        return n

    def newer_elsewhere(self, agent_id: str) -> bool:
        """Whether another server published a newer cache of the agent than the one here (False without a
        remote tier, or when it does not answer)."""
        if self.remote is None:
            return False
        theirs = self.remote.version(agent_id)
        with self._lock:
            ours = self._versions.get(agent_id)
        return theirs is not None and (ours is None or theirs > ours)

    def _fetch_newer(self, agent_id: str) -> int | None:
        """Bring the agent's remote cache file here when it is newer than the local one (called under the
        agent's lock); the version fetched, or None. The bytes become the local file, checked on load."""
        if not self.newer_elsewhere(agent_id):
            return None
        got = self.remote.fetch(agent_id)
        if got is None:
            return None
        path = self.dir / file_name(agent_id)
        tmp = atomic.temp_name(path)
        try:
            with open(tmp, "wb") as f:
                f.write(got.data)
            info = cachefile.read_header(tmp)
            if info.model_fingerprint != self.fingerprint or info.spec != self.spec or info.agent_id != agent_id:
                raise CacheMismatchError(f"the remote cache of {agent_id!r} is another model's, spec's or agent's")
            os.replace(tmp, path)
        except (CacheCorruptError, CacheMismatchError) as exc:
            log.warning("agent %r: the remote cache (version %d) is refused: %s", agent_id, got.version, exc)
            self.remote.drop(agent_id, got.version)
            atomic.unlink_quietly(tmp)
            return None
        except OSError as exc:  # the local disk cannot take it: the next turn prefills
            log.warning("agent %r: cannot keep the remote cache here: %s", agent_id, exc)
            with contextlib.suppress(OSError):
                atomic.unlink_quietly(tmp)
            return None
        with self._lock:
            self._disk[agent_id] = _OnDisk(path, path.stat().st_size)
            self._disk.move_to_end(agent_id)
            self._versions[agent_id] = got.version
        return got.version

    def delete(self, agent_id: str) -> bool:
        """Forget ``agent_id`` and delete its file; True if it was stored."""
        validate_agent_id(agent_id)
        with self._agent_lock(agent_id):
            with self._lock:
                entry = self._disk.pop(agent_id, None)
            if entry is not None:
                atomic.unlink_quietly(entry.path)
                _unlink_extra(entry.path)
            return entry is not None

    def save_extra(self, agent_id: str, doc: dict) -> bool:
        """Keep a small JSON document beside the agent's cache file (deleted with it); False if it could not
        be written. Crash-safe (written aside, then renamed) but not fsynced: it is a hint that makes a
        cache hit longer, never what makes a reply right."""
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

    def agents(self) -> list[str]:
        """Ids of the stored agents, sorted."""
        with self._lock:
            return sorted(self._disk)

    def effective_budget(self) -> int:
        """The bytes of files the store may hold now: the configured budget, or less when the filesystem
        leaves less (our files plus the free space beyond the reserve)."""
        return self.stats().disk["effective_budget_bytes"]

    def stats(self) -> StoreStats:
        with self._lock:
            ours = sum(e.nbytes for e in self._disk.values())
            disk = self.health.snapshot()  # one statvfs: the room below comes from it
            room = disk["room_bytes"]
            disk["effective_budget_bytes"] = self.disk_budget if room is None else min(self.disk_budget, ours + room)
            return StoreStats(
                disk_hits=self._counts["disk_hits"],
                misses=self._counts["misses"],
                disk_evictions=self._counts["disk_evictions"],
                disk_agents=len(self._disk),
                disk_bytes=ours,
                quarantined=len(self.quarantined),
                disk=disk,
            )

    @property
    def quarantined(self) -> list[Quarantined]:
        """The files refused since the store opened (guarded by the store's lock)."""
        return self._quarantine.refused

    # ------------------------------------------------------------ the pool, for admission

    @property
    def block_tokens(self) -> int:
        return self.pool.block_tokens

    @property
    def total_blocks(self) -> int:
        return self.pool.total_blocks

    def free_blocks(self) -> int:
        """Blocks the pool can hand out now."""
        with self.pool_lock:
            return self.pool.free_count

    def blocks_to_take(self, token_ids, salt_root: int | None = None) -> int:
        """Free blocks a cache of ``token_ids`` (keyed under ``salt_root``) would take now (its blocks already pooled are shared)."""
        with self.pool_lock:
            return blockplan.plan_blocks(self.pool, self.spec, token_ids, salt_root=salt_root).need

    def _check_live(self, blocks: AgentBlocks) -> None:
        """Refuse blocks that were released or that live in another pool."""
        if blocks.released:
            raise CacheMismatchError("these AgentBlocks were released")
        with self.pool_lock:
            if any(b.block_id >= self.pool.total_blocks or self.pool.refcount(b) == 0 for b in blocks.unique_blocks()):
                raise CacheMismatchError("these blocks are not live in this store's pool")

    # ------------------------------------------------------------ disk tier

    def _load_file(self, agent_id: str, entry: _OnDisk) -> AgentBlocks | None:
        try:
            return cachefile.load(entry.path, self.pool, model_fingerprint=self.fingerprint, lock=self.pool_lock)
        except CacheCorruptError as exc:
            self._forget(agent_id)
            self._quarantine.set_aside(entry.path, exc.reason)
            return None
        except (CacheMismatchError, FileNotFoundError) as exc:
            # replaced by another model's file, or removed behind our back
            log.warning("agent %r: cannot load %s: %s", agent_id, entry.path, exc)
            self._forget(agent_id)
            return None
        except OSError as exc:  # unreadable now (permissions, I/O): a miss; the file may read again later
            log.warning("agent %r: cannot read %s: %s", agent_id, entry.path, exc)
            with self._lock:
                self._counts["misses"] += 1
            return None

    def _forget(self, agent_id: str) -> None:
        with self._lock:
            self._disk.pop(agent_id, None)
            self._counts["misses"] += 1

    def _disk_trim(self, keep: str) -> None:
        """Delete least recently used files until the disk tier fits its budget.

        Agents busy in another thread are skipped rather than waited for.
        """
        while True:
            with self._lock:
                total = sum(e.nbytes for e in self._disk.values())
                if total <= self.disk_budget:
                    return
                candidates = [a for a in self._disk if a != keep]
            for victim in candidates:
                lock = self._agent_lock(victim)
                if lock.acquire(blocking=False):
                    break
            else:
                return  # every other agent is busy: try again on the next save
            try:
                with self._lock:
                    entry = self._disk.get(victim)
                if entry is not None:
                    try:
                        atomic.unlink_quietly(entry.path)
                    except OSError as exc:  # a read-only directory: the file stays, and so does its entry
                        log.warning("cannot delete %s to hold the disk budget: %s", entry.path, exc)
                        return
                    _unlink_extra(entry.path)
                    with self._lock:
                        self._counts["disk_evictions"] += self._disk.pop(victim, None) is not None
            finally:
                lock.release()

    def _scan(self) -> None:
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
                self._quarantine.set_aside(path, exc.reason)
                continue
            except OSError as exc:
                log.warning("skipping unreadable cache file %s: %s", path, exc)
                continue
            if info.model_fingerprint != self.fingerprint or info.spec != self.spec:
                self.foreign.append(str(path))
                continue
            try:
                expected = file_name(info.agent_id)
            except InvalidAgentIdError:
                expected = None
            if expected != path.name:
                self._quarantine.set_aside(path, f"file name does not match its agent id {info.agent_id!r}")
                continue
            found.append((path.stat().st_mtime_ns, info.agent_id, _OnDisk(path, info.nbytes)))
        with self._lock:
            # newest first, each put in front: least recently used first, ahead of what this process saved
            for mtime_ns, agent_id, entry in sorted(found, key=lambda x: (x[0], x[1]), reverse=True):
                if agent_id not in self._disk:
                    self._disk[agent_id] = entry
                    self._disk.move_to_end(agent_id, last=False)
                    # written at or after its version was stamped: a remote copy of the same save is not newer
                    self._versions.setdefault(agent_id, mtime_ns)
        self._scanned = True
        self._disk_trim(keep="")

    def _agent_lock(self, agent_id: str) -> threading.Lock:
        with self._lock:
            return self._agent_locks.setdefault(agent_id, threading.Lock())


def _unlink_extra(cache_path: Path) -> None:
    """Delete the extra document beside a cache file, if any (a read-only directory keeps it)."""
    with contextlib.suppress(OSError):
        atomic.unlink_quietly(str(cache_path) + EXTRA_SUFFIX)
