"""Agents' caches kept across restarts: :class:`AgentCacheStore`, under a disk budget.

``save`` writes the agent's cache (crash-safe: its block files, then its manifest) before it returns;
``load`` reads it back into the pool (verified), else ``None``. So every saved cache survives a crash.
The caches kept in RAM between turns are the scheduler's (``semantic.sched.residency``, under its RAM
budget): this store holds no blocks of its own::

    save(a) ──► a's new block files, then its manifest (fsynced)
    load(a) ──► manifest? ──► blocks in the pool (the caller's), else None
    disk over budget  ──► delete least recently used agents (never the one just saved)
    disk full, read-only or gone ──► CacheSaveError (``semantic.store.diskhealth``): nothing deleted, retried later

The store is the facade over one module per idea::

    blocklayout.py  the default layout: block files written once and shared, a manifest per agent
    filelayout.py   one file per agent, rewritten by every save (``layout="file"``, kept to measure against;
                    the block layout reads and converts such files it finds)
    agentindex.py   what both layouts share: the index, least recently used first, names from agent ids,
                    deletion and refusal (``quarantine.py``: files that failed their checks, set aside)
    disk.py         the disk budget (least recently used agents go) and the directory's health
    fetch.py        the tier shared with other servers: publish on save, fetch what is newer, prefetch

A directory that cannot be created or written is no error: the store serves
what it can read, saves fail with :class:`CacheSaveError` (tried again after
a back-off), and the scan runs once the directory is usable.

Threads: calls for different agents run concurrently (file reads and writes
happen outside every shared lock); calls for the same agent are serialized
by its agent lock. One store lock guards the index, the versions, the
counters, the disk health and the quarantine list; it is held briefly and
never while waiting for another lock (the budget's trim only tries agents'
locks, and skips those it cannot get). Every use the store makes of ``pool``
holds :attr:`AgentCacheStore.pool_lock`, and so do the releases of the
AgentBlocks it returns; anything else that uses the same pool from another
thread must hold it too.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from semantic.cache import blockclaim
from semantic import cachefile
from semantic.cache.blocks import AgentBlocks
from semantic.store.diskhealth import DiskHealth
from semantic.errors import CacheMismatchError
from semantic.cache.pool import BlockPool
from semantic.request import validate_agent_id
from semantic.cache.spec import ModelCacheSpec
from semantic.store.disk import DiskBudget
from semantic.store.fetch import RemoteFetch
from semantic.store.blocklayout import BlockFiles, prefix_id
from semantic.store.filelayout import AgentFiles
from semantic.store.quarantine import Quarantine, Quarantined

LAYOUTS = ("blocks", "file")

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
    layout: str = "blocks"
    disk_shared_bytes: int = 0   # block files two agents or more use
    disk_unique_bytes: int = 0   # what only one agent uses (its block files, manifest, or cache file)
    disk_block_files: int = 0
    written_bytes: int = 0       # bytes saves wrote since the store opened
    collected: int = 0           # block files deleted once no manifest named them
    newer: int = 0               # manifests of a newer build, left alone


class AgentCacheStore:
    """Agents' caches as files in ``cache_dir`` (least recently used go first
    over ``disk_budget_bytes``), for one model and spec.

    Args:
        cache_dir: created if missing; holds the agents' manifests and block files (or, in the file
            layout, one file per agent).
        spec: the cache spec every saved and loaded cache must have.
        model_fingerprint: written into each file; files of other models
            are left alone and not indexed.
        disk_budget_bytes: bytes of files the store may keep (a soft
            limit: the file just saved is never deleted to meet it).
        pool: the block pool loaded caches go into (the executor's pool).
        durable: fsync each file and the directory on save.
        remote: a tier shared with other servers of the model: a ``redis://`` URL, or a
            :class:`semantic.store.remote.RemoteTier` (for its options, such as a budget); None: this machine only.
        layout: "blocks" (block files written once, a manifest per agent: ``blocklayout``) or "file"
            (one file per agent, rewritten by every save: ``filelayout``, kept to measure against).
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
        layout: str = "blocks",
    ):
        if not isinstance(model_fingerprint, str) or not model_fingerprint:
            raise ValueError(f"model_fingerprint must be a non-empty string, got {model_fingerprint!r}")
        if disk_budget_bytes < 0:
            raise ValueError(f"budgets must be >= 0 bytes, got a disk budget of {disk_budget_bytes}")
        spec.require_same(pool.spec, "the pool")
        self.dir = Path(cache_dir)
        self.spec, self.fingerprint, self.pool, self.durable = spec, model_fingerprint, pool, durable
        self.pool_lock = threading.RLock()
        self._lock = threading.Lock()  # the index and counters, the health, the refused; never held during file I/O
        self._quarantine = Quarantine(self.dir, self._lock)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout = layout
        if layout == "blocks":
            self._files = BlockFiles(self.dir, spec, model_fingerprint, durable=durable, lock=self._lock,
                                     quarantine=self._quarantine, block_tokens=pool.block_tokens)
        else:
            cachefile.fileformat.refuse_recurrent(spec)  # UnsupportedCacheError: its state has no positions
            self._files = AgentFiles(self.dir, spec, model_fingerprint, durable=durable, lock=self._lock,
                                     quarantine=self._quarantine)
        self.written_bytes = 0
        self._budget = DiskBudget(self.dir, disk_budget_bytes, files=self._files, lock=self._lock)
        if remote is not None and layout != "blocks":
            raise ValueError("the shared tier keeps the blocks layout: use layout='blocks' with a remote tier")
        self._fetch = RemoteFetch(remote, self._files, pool=pool, pool_lock=self.pool_lock, lock=self._lock)
        if self._fetch.remote is not None:
            self._files.on_remote_bad = self._fetch.remote.drop_block
        try:
            self._scan()
        except OSError as exc:  # served from RAM until the directory can be used (the next save tries again)
            with self._lock:
                self.health.failed(exc)

    # ------------------------------------------------------------ public

    def save(self, agent_id: str, blocks: AgentBlocks, prepared: cachefile.PreparedSave | None = None,
             bytes_out: Callable[[], None] = lambda: None) -> None:
        """Write ``agent_id``'s cache file (durable unless the store is not).

        The caller keeps (and may release) ``blocks``: the store keeps no
        reference. ``prepared`` (``cachefile.prepare_save``) lets a write-behind
        thread save without any MLX work of its own; it is let go of once its bytes
        are written, before they are made durable, and then ``bytes_out`` is called.
        """
        validate_agent_id(agent_id)
        self.spec.require_same(blocks.spec, "these blocks")
        self._check_live(blocks)  # before any write: blocks of another pool are refused
        if prepared is None:
            prepared = cachefile.prepare_save(blocks)
        with self._files.agent_lock(agent_id):
            need = self._files.bytes_to_write(blocks, prepared)
            with self._lock:
                self.health.check(need)  # raises while backing off or when the disk has no room
            try:
                if not self._files.scanned:
                    self._scan()  # the directory is usable again (or for the first time): index what it holds
                entry = self._files.write(agent_id, blocks, prepared, bytes_out)
            except OSError as exc:
                with self._lock:
                    err = self.health.failed(exc)
                    if err.kind == "missing":
                        self._files.scanned = False  # the next try makes the directory again and indexes it
                raise err from None
            with self._lock:
                self.health.ok()
                version = self._files.put(agent_id, entry)
                self.written_bytes += entry.written
            self._files.collect()
            self._fetch.publish(agent_id, entry, version, blocks)
        self._budget.trim(keep=agent_id)

    def load(self, agent_id: str, for_ids: Sequence[int] | None = None) -> AgentBlocks | None:
        """``agent_id``'s cache read from its file into the pool (a new reference the caller owns), or None.

        A file that fails verification is quarantined and reported as a miss. ``for_ids``: the prompt of the
        turn it is read for; one that extends the saved history leaves its earlier snapshots on disk
        (``blockload.load``).

        Raises:
            PoolExhaustedError: the pool has no room for the file's blocks
                (the file stays; make room and load again).
        """
        validate_agent_id(agent_id)
        with self._files.agent_lock(agent_id):
            fetched = self._fetch.fetch_newer(agent_id)
            blocks = self._files.load(agent_id, self.pool, self.pool_lock, for_ids)
            if blocks is None and fetched is not None:  # what another server published failed its checks here
                self._fetch.refused(agent_id, fetched)
        if fetched is not None:  # a file came from elsewhere: the disk tier holds to its budget as on a save
            self._budget.trim(keep=agent_id)
        return blocks

    def load_prefix(self, token_ids, salt_root: int | None = None, beyond: int = 0) -> int:
        """Bring into the pool the longest prefix of ``token_ids`` that this disk's block files hold, any
        agent's (a system prompt another agent saved before a restart), when it is longer than ``beyond``
        tokens; its blocks stay pooled for the turn to hit. Returns the tokens brought in (0: none).

        Raises:
            PoolExhaustedError: the pool has no room for them (nothing taken).
        """
        if not hasattr(self._files, "load_prefix"):  # the single-file layout shares nothing between agents
            return 0
        got = 0
        kept = self._files.kept_prefix(token_ids, salt_root)
        if kept is not None and kept[0] > beyond:
            got = self._pooled(self.load(kept[1]))
        got = max(got, self._pooled(self._files.load_prefix(token_ids, salt_root, max(beyond, got), self.pool,
                                                            self.pool_lock)))
        return got

    def prefix_ids(self, token_ids, salt_root: int | None, ends: Sequence[int]) -> list[str]:
        """The entry ids under which the caches of ``token_ids``' first ``end`` tokens are kept apart from any
        agent's (a sliding-window model's system prompt, ``Scheduler._keep_prefix``; :meth:`load_prefix` finds
        them), one per end of ``ends``: each a whole number of blocks, at least one."""
        bt = self.block_tokens
        assert all(e > 0 and e % bt == 0 for e in ends), (ends, bt)
        chain = blockclaim.chain_keys(token_ids[: max(ends, default=0)], bt, salt_root)  # a chain's keys: its prefix's
        return [prefix_id(chain[e // bt - 1]) for e in ends]

    def _pooled(self, blocks: AgentBlocks | None) -> int:
        """Leave a loaded cache's blocks in the pool's free queue, hittable until recycled: its tokens."""
        if blocks is None:
            return 0
        with self.pool_lock:
            n = blocks.total_tokens
            blocks.release()
        return n

    def prefetch(self, token_ids, salt_root: int | None = None) -> int:
        """Bring into the pool the leading full blocks of ``token_ids`` that it lacks and another server
        published (the holder's file, fetched, kept on local disk and loaded; its blocks stay pooled for
        the turn to hit). Returns the blocks gained; 0 without a remote tier or when nothing helps."""
        return self._fetch.prefetch(token_ids, salt_root, self.load)

    def newer_elsewhere(self, agent_id: str) -> bool:
        """Whether another server published a newer cache of the agent than the one here (False without a
        remote tier, or when it does not answer)."""
        return self._fetch.newer_elsewhere(agent_id)

    def delete(self, agent_id: str) -> bool:
        """Forget ``agent_id`` and delete its file; True if it was stored."""
        validate_agent_id(agent_id)
        with self._files.agent_lock(agent_id):
            return self._files.evict(agent_id)

    def save_extra(self, agent_id: str, doc: dict) -> bool:
        """Keep a small JSON document beside the agent's cache file (deleted with it); False if it could not
        be written. Crash-safe (written aside, then renamed) but not fsynced: it is a hint that makes a
        cache hit longer, never what makes a reply right."""
        return self._files.save_extra(agent_id, doc)

    def load_extra(self, agent_id: str) -> dict | None:
        """The document :meth:`save_extra` kept for the agent, or None (none, unreadable, not a JSON object)."""
        return self._files.load_extra(agent_id)

    def has(self, agent_id: str) -> bool:
        """Whether the agent's cache is on disk (indexed)."""
        with self._lock:
            return self._files.get(agent_id) is not None

    def on_disk(self, agent_id: str) -> tuple[int, float] | None:
        """How many tokens the agent's cache on disk holds and when it was saved (mtime), or None (none,
        unreadable)."""
        with self._lock:
            entry = self._files.get(agent_id)
        tokens = None if entry is None else self._files.tokens(agent_id)
        try:
            return None if tokens is None else (tokens, entry.path.stat().st_mtime)
        except OSError:
            return None

    def agents(self) -> list[str]:
        """Ids of the stored agents, sorted."""
        with self._lock:
            return self._files.agents()

    def effective_budget(self) -> int:
        """The bytes of files the store may hold now: the configured budget, or less when the filesystem
        leaves less (our files plus the free space beyond the reserve)."""
        return self.stats().disk["effective_budget_bytes"]

    def stats(self) -> StoreStats:
        with self._lock:
            ours = self._files.total_bytes()
            shared, unique = self._files.shared_bytes()
            blocks = getattr(self._files, "index", None)
            return StoreStats(
                disk_hits=self._files.hits,
                misses=self._files.misses,
                disk_evictions=self._budget.evictions,
                disk_agents=self._files.count(),
                disk_bytes=ours,
                quarantined=len(self.quarantined),
                disk=self._budget.snapshot(ours),
                layout=self.layout,
                disk_shared_bytes=shared,
                disk_unique_bytes=unique,
                disk_block_files=len(blocks.infos) if blocks is not None else 0,
                written_bytes=self.written_bytes,
                collected=getattr(self._files, "collected", 0),
                newer=len(getattr(self._files, "newer", ())),
            )

    @property
    def disk_budget(self) -> int:
        """Bytes of files the store may keep (the configured budget)."""
        return self._budget.budget

    @disk_budget.setter
    def disk_budget(self, nbytes: int) -> None:
        self._budget.budget = nbytes

    @property
    def health(self) -> DiskHealth:
        """The cache directory's state for saves (guarded by the store's lock)."""
        return self._budget.health

    @health.setter
    def health(self, health: DiskHealth) -> None:
        self._budget.health = health

    @property
    def remote(self):
        """The tier shared with other servers (a :class:`semantic.store.remote.RemoteTier`), or None."""
        return self._fetch.remote

    @property
    def quarantined(self) -> list[Quarantined]:
        """The files refused since the store opened (guarded by the store's lock)."""
        return self._quarantine.refused

    @property
    def foreign(self) -> list[str]:
        """Files of another model or spec, left in place."""
        return self._files.foreign

    @property
    def cleaned(self) -> list[str]:
        """Leftover temporary files deleted on startup."""
        return self._files.cleaned

    # ------------------------------------------------------------ the pool, for admission

    @property
    def block_tokens(self) -> int:
        return self.pool.block_tokens

    @property
    def capacity(self) -> int:
        """The pool's bytes (``semantic.cache.room``)."""
        return self.pool.capacity

    def free_bytes(self) -> int:
        """Bytes the pool can hand out now."""
        with self.pool_lock:
            return self.pool.free_bytes

    def claim(self, token_ids, salt_root: int | None = None) -> blockclaim.BlockClaim:
        """What a cache of ``token_ids`` (keyed under ``salt_root``) would take from the pool now (its blocks
        already pooled are shared): bytes, and blocks missed per group."""
        with self.pool_lock:
            return blockclaim.claim_blocks(self.pool, self.spec, token_ids, salt_root=salt_root)

    def _check_live(self, blocks: AgentBlocks) -> None:
        """Refuse blocks that were released or that live in another pool."""
        if blocks.released:
            raise CacheMismatchError("these AgentBlocks were released")
        with self.pool_lock:
            if any(self.pool.refcount(b) == 0 for b in blocks.unique_blocks()):
                raise CacheMismatchError("these blocks are not live in this store's pool")

    def _scan(self) -> None:
        """Index the directory's files, then hold them to the budget (raises OSError when the directory
        cannot be created or listed)."""
        self._files.scan()
        self._budget.trim(keep="")
