"""The store's side of a tier shared with other servers of the model (the tier itself: ``semantic.store.remote``).

::

    save(a)        ─► publish(a, manifest, version, its block files, chain keys)   sent behind the call
    load(a)        ─► newer elsewhere? ─► its manifest ─► only the block files this disk lacks
                      ─► kept on local disk (headers checked) ─► loaded as any manifest
    prefetch(ids)  ─► leading full blocks the pool lacks ─► the agent holding them ─► load(that agent)

Each local manifest has a version (the index's: the ``time_ns`` of its save, a
fetched copy's own, or after a restart its mtime); another server's copy is
fetched only when its version is newer. Bytes from elsewhere are trusted no
more than files on disk: a manifest of another model, spec or agent, or a
block that fails its checks, is refused and dropped from the tier.
Without a tier (``remote=None``) every call here is a no-op.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from semantic.cache import blockclaim
from semantic.cache.blocks import AgentBlocks
from semantic.errors import (CacheCorruptError, CacheFormatError, CacheMismatchError, InvalidAgentIdError,
                             PoolExhaustedError)
from semantic.cache.pool import BlockPool
from semantic.request import validate_agent_id
from semantic.cachefile import atomic
from semantic.store import blockformat, manifest
from semantic.store.blockformat import BlockInfo
from semantic.store.blocklayout import BlockFiles
from semantic.store.blockindex import Held
from semantic.store.manifest import manifest_name

log = logging.getLogger(__package__)  # the store's one logger: its lines keep the name they had


class RemoteFetch:
    """Publishes the files saved here and fetches those other servers saved.

    Args:
        remote: a ``redis://`` URL, a :class:`semantic.store.remote.RemoteTier`, or None (this machine only).
        files: the index that fetched files join.
        pool: the pool loaded caches go into.
        pool_lock: held for every use of ``pool``.
        lock: the store's lock, which guards the index's versions.
    """

    def __init__(self, remote, files: BlockFiles, *, pool: BlockPool, pool_lock: threading.RLock,
                 lock: threading.Lock):
        if isinstance(remote, str):
            from semantic.store.remote import RemoteTier

            remote = RemoteTier(remote, files.fingerprint)
        self.remote = remote  # a RemoteTier shared with other servers (``semantic.store.remote``), or None
        self.files, self.pool, self.pool_lock, self.lock = files, pool, pool_lock, lock

    def publish(self, agent_id: str, held, version: int, blocks: AgentBlocks) -> None:
        """Offer the manifest just saved, and its block files, to the other servers (the tier reads and
        sends them on its thread, only the blocks it lacks).

        Args:
            held, version: the saved manifest (``blockfiles.Held``) and its version.
            blocks: the cache saved (its chain keys let others find its blocks).
        """
        if self.remote is not None:  # behind this call: read and sent by its thread
            chain = blockclaim.chain_keys(blocks.token_ids, self.pool.block_tokens, blocks.salt_root)
            self.remote.publish(agent_id, held.path, version, chain, self.files.block_paths(held.keys))

    def newer_elsewhere(self, agent_id: str) -> bool:
        """Whether another server published a newer cache of the agent than the one here (False without a
        remote tier, or when it does not answer)."""
        if self.remote is None:
            return False
        theirs = self.remote.version(agent_id)
        with self.lock:
            ours = self.files.version(agent_id)
        return theirs is not None and (ours is None or theirs > ours)

    def fetch_newer(self, agent_id: str) -> int | None:
        """Bring the agent's remote manifest here, with the block files this disk lacks, when it is newer
        than the local one (called under the agent's lock); the version fetched, or None. Block headers are
        checked as they arrive, their tensors on load."""
        if not self.newer_elsewhere(agent_id):
            return None
        got = self.remote.fetch(agent_id)
        if got is None:
            return None
        try:
            held = adopt(self.files, agent_id, got.data, self.remote.fetch_blocks, self.remote.drop_block)
        except (CacheCorruptError, CacheMismatchError, CacheFormatError) as exc:
            log.warning("agent %r: the remote cache (version %d) is refused: %s", agent_id, got.version, exc)
            self.remote.drop(agent_id, got.version)
            return None
        except OSError as exc:  # the local disk cannot take it: the next turn prefills
            log.warning("agent %r: cannot keep the remote cache here: %s", agent_id, exc)
            return None
        with self.lock:
            self.files.put(agent_id, held, got.version)
        self.files.collect()
        return got.version

    def refused(self, agent_id: str, version: int) -> None:
        """The copy of ``version`` fetched for the agent failed its checks here: the tier drops it."""
        self.remote.drop(agent_id, version)

    def prefetch(self, token_ids, salt_root: int | None, load: Callable[[str], AgentBlocks | None]) -> int:
        """Bring into the pool the leading full blocks of ``token_ids`` that it lacks and another server
        published (the holder's file, fetched, kept on local disk and loaded; its blocks stay pooled for
        the turn to hit).

        Args:
            load: the store's load (fetches the holder's file when it is newer elsewhere).

        Returns:
            The blocks gained; 0 without a remote tier or when nothing helps.
        """
        if self.remote is None:
            return 0
        chain = blockclaim.chain_keys(token_ids, self.pool.block_tokens, salt_root)
        have = self._pooled(token_ids, chain, salt_root)
        if have == len(chain):
            return 0
        found = self.remote.holder(chain[have:])
        if found is None:
            return 0
        n, holder = found
        try:
            validate_agent_id(holder)
            blocks = load(holder)
        except (InvalidAgentIdError, PoolExhaustedError) as exc:
            log.info("prefix of %d blocks held by %r not loaded: %s", n, holder, exc)
            return 0
        if blocks is None:
            return 0
        with self.pool_lock:
            blocks.release()  # its keyed blocks stay in the pool's free queue, hittable until recycled
        return n

    def _pooled(self, token_ids, chain, salt_root: int | None) -> int:
        """Leading full blocks that every group holding them (global layers) has pooled."""
        bt = self.pool.block_tokens
        with self.pool_lock:
            plan = blockclaim.claim_blocks(self.pool, self.files.spec, token_ids, chain, salt_root=salt_root)
        have = len(chain)
        for group in {p.group for p in plan.blocks if not p.snapshot}:  # a snapshot is no leading block
            spans = [p for p in plan.blocks if p.group == group]
            if spans and spans[0].start == 0:
                hits = 0
                for p in spans:
                    if p.hit is None or p.end - p.start != bt:
                        break
                    hits += 1
                have = min(have, hits)
        return have


def adopt(files, agent_id: str, data: bytes, fetch_blocks, drop_block) -> Held:
    """Make ``data`` (a manifest from another server) the agent's, with the block files it names that
    this disk lacks (``fetch_blocks(keys) -> {key: bytes}``; one that fails its header check goes to
    ``drop_block(key)``); not indexed yet (the caller's :meth:`put` does). A block the tier no longer
    holds is simply absent: the agent loads the prefix before it.

    Raises:
        CacheCorruptError, CacheMismatchError, CacheFormatError: ``data`` is no manifest of this model,
            spec and agent.
        OSError: the directory did not take them.
    """
    path = files.dir / manifest_name(agent_id)
    m = manifest.parse(f"the remote manifest of {agent_id!r}", data, files.spec, files.fingerprint, files.bt)
    if m.agent_id != agent_id:
        raise CacheMismatchError(f"the remote manifest of {agent_id!r} is another agent's")
    with files.lock:
        missing = sorted(k for k in m.keys() if k not in files.index.infos)
    pins = set()
    try:
        got = fetch_blocks(missing)
        if got:
            files.blocks_dir.mkdir(exist_ok=True)
        for key, raw in got.items():
            with files.files_lock:  # not while a collector deletes an old copy of it
                info = _keep_block(files, key, raw, drop_block)
                if info is not None:
                    with files.lock:
                        files.index.add(info)
                        files.index.pin([info.key])
                        files.from_remote.add(info.key)
            if info is not None:
                pins.add(info.key)
        if got and files.durable:
            atomic.fsync_path(str(files.blocks_dir))
        n = manifest.write(str(path), m, files.durable)
    except BaseException:
        with files.lock:
            files.index.unpin(pins)
        files.collect()
        raise
    if m.extra is not None:
        with files.lock:
            files.extras[agent_id] = m.extra
    return Held(path, n, frozenset(m.keys()), written=n, pins=frozenset(pins))


def _keep_block(files, key: int, raw: bytes, drop_block) -> BlockInfo | None:
    """A fetched block written to its file once its header checks (else dropped from the tier)."""
    path = files.blocks_dir / blockformat.key_name(key)
    tmp = atomic.temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            if files.durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        atomic.unlink_quietly(tmp)
        raise
    try:
        return blockformat.read_header(str(path), files.spec, files.fingerprint)
    except CacheCorruptError as exc:
        log.warning("a block fetched from the shared tier is refused: %s", exc.reason)
        atomic.unlink_quietly(path)
        drop_block(key)
        return None
