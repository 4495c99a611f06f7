"""The agents' caches as block files written once and a small manifest per agent (the default layout).

::

    <cache dir>/
        <slug>-<digest>.kvm          one manifest per agent (``manifest``): its tokens and extents
        blocks-<model digest>/
            <key>.kvb                block files (``blockformat``), shared by every manifest that names them:
                                     positions of a group, or a snapshot of a group that resumes only from one
                                     (one file per snapshot the agent's cache carries)
        quarantine/                  files that failed their checks
        <slug>-<digest>.safetensors  a cache file of the single-file layout: converted on its first load

A save writes the block files its history lacks (``blockindex``: usually the
turn's new tokens and nothing else), fsyncs them and their directory, then
writes the manifest atomically; a crash anywhere leaves the old manifest or
the new one, and the files no manifest names are deleted. Evicting an agent
deletes its manifest and the files no other manifest names. A block file that
fails its checks is quarantined: every agent that uses it resumes from the
blocks before it.

Same interface as :class:`semantic.store.filelayout.AgentFiles` (the single-file
layout, kept for comparison): the store holds one or the other.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Sequence

import xxhash

from semantic import cachefile
from semantic.cache.blockclaim import chain_keys
from semantic.cache.blocks import AgentBlocks
from semantic.cachefile import atomic
from semantic.cachefile.fileformat import ST_DTYPES
from semantic.errors import CacheCorruptError, CacheFormatError, CacheMismatchError
from semantic.cache.pool import BlockPool
from semantic.cache.spec import ModelCacheSpec
from semantic.store import blockformat, blockload, blockscan, manifest
from semantic.store.blockformat import BlockInfo
from semantic.store.agentindex import AgentIndex
from semantic.store.blockindex import BlockIndex, Held, NewBlock
from semantic.store.agentindex import EXTRA_SUFFIX, delete
from semantic.store.manifest import Manifest, manifest_name
from semantic.store.quarantine import Quarantine

log = logging.getLogger(__package__)

# a system prompt's cache kept as an entry of its own, named by the chain key of its last block: a window of
# a block or more keeps only the end of each history in its agent's file, so no agent's file rebuilds it
PREFIX = "~prefix/"


def prefix_id(key: int) -> str:
    """The entry id of the prefix whose last full block has chain key ``key``."""
    return f"{PREFIX}{key & 0xFFFFFFFFFFFFFFFF:016x}"


class BlockFiles(AgentIndex):
    """Manifests and block files in ``directory``, for one model, spec and block size.

    Args: as :class:`AgentFiles`, and ``block_tokens``, the pool's block size.
    """

    def __init__(self, directory: Path, spec: ModelCacheSpec, fingerprint: str, *, durable: bool,
                 lock: threading.Lock, quarantine: Quarantine, block_tokens: int):
        super().__init__(directory, spec, fingerprint, durable=durable, lock=lock, quarantine=quarantine)
        self.bt = block_tokens
        # a newer block format (or another model, spec, block size) gets a folder of its own
        key = f"{fingerprint}|{spec.fingerprint()}|{block_tokens}|{blockformat.DIR_VERSION}"
        digest = xxhash.xxh3_64(key.encode()).hexdigest()[:12]
        self.blocks_dir = directory / f"blocks-{digest}"
        self.index = BlockIndex()
        self.newer: list[str] = []    # manifests and block files of a newer build: left alone
        self.hold_all = False         # a newer manifest named blocks this build cannot list: collect nothing
        self.collected = 0            # block files deleted once no manifest used them
        self.files_lock = threading.Lock()  # a block file's writing and indexing, or its deletion: one at a time
        self.extras: dict[str, dict] = {}
        self._extra_stale: set[str] = set()
        self.from_remote: set[int] = set()  # block files fetched from the shared tier
        self.on_remote_bad = None             # drop_block of the shared tier: a fetched block failed its checks

    # ------------------------------------------------------------ the index (and AgentIndex's)

    def put(self, agent_id: str, held: Held, version: int | None = None) -> int:
        """Index ``held`` as the agent's, most recently used; its block files' references move from the
        agent's old manifest to it (under the lock). Returns the version recorded."""
        old = self.entries.get(agent_id)
        self.index.reference(set(held.keys), set(old.keys) if old is not None else set())
        self.index.unpin(held.pins)
        held.pins = frozenset()
        return self.stamp(agent_id, held, version)

    def pop(self, agent_id: str) -> Held | None:
        held = self.entries.pop(agent_id, None)
        if held is not None:
            self.index.reference(set(), set(held.keys))
        return held

    def total_bytes(self) -> int:
        return self.index.total_bytes() + sum(h.nbytes for h in self.entries.values())

    def shared_bytes(self) -> tuple[int, int]:
        """Bytes of block files two agents or more use, and bytes only one agent uses (manifests and
        unconverted files included)."""
        shared, unique = self.index.shared_bytes()
        return shared, unique + sum(h.nbytes for h in self.entries.values())

    def tokens(self, agent_id: str) -> int | None:
        """How many tokens the agent's cache on disk holds, or None (not indexed, unreadable)."""
        with self.lock:
            held = self.entries.get(agent_id)
        if held is None:
            return None
        try:
            if held.legacy:
                return cachefile.read_header(held.path).total_tokens
            return manifest.read(str(held.path), self.spec, self.fingerprint, self.bt).total_tokens
        except (OSError, CacheCorruptError, CacheMismatchError, CacheFormatError):
            return None

    # ------------------------------------------------------------ writing

    def bytes_to_write(self, blocks: AgentBlocks, prepared: cachefile.PreparedSave) -> int:
        """About how many bytes a save of ``blocks`` writes now: the K/V of the positions no block file
        holds, and the manifest (headers add a few KiB per file)."""
        chain = chain_keys(blocks.token_ids, self.bt, blocks.salt_root)
        with self.lock:
            files = self.index.files_for(self.spec, blocks.token_ids, chain, blocks.salt_root, prepared.stored_from, self.bt,
                                   _earlier_ends(prepared))
        per_group = {g: sum(self.spec.layers[i].token_bytes() for i in layers) for g, layers in self.spec.groups().items()}
        return int(sum(_snapshot_bytes(self.spec, nb) if nb.snapshot else (nb.end - nb.start) * per_group[nb.group]
                       for nb in files.new)) + 8 * len(blocks.token_ids)

    def write(self, agent_id: str, blocks: AgentBlocks, prepared: cachefile.PreparedSave,
              bytes_out: Callable[[], None] = lambda: None) -> Held:
        """Write the block files ``blocks`` lacks on disk, then the agent's manifest; not indexed yet
        (the caller's :meth:`put` does, then :meth:`collect`). Once every block's bytes are in the files,
        before any fsync, ``prepared`` lets go of its views (:meth:`~cachefile.PreparedSave.release`) and
        ``bytes_out`` is called: a turn may write into the pool's buffers in place from then on.

        Raises:
            OSError: the directory did not take it (what was written is collected).
        """
        tokens = blocks.token_ids
        chain = chain_keys(tokens, self.bt, blocks.salt_root)
        with self.lock:
            files = self.index.files_for(self.spec, tokens, chain, blocks.salt_root, prepared.stored_from, self.bt,
                                   _earlier_ends(prepared))
            self.index.pin(files.reused)
        pins, written, paths = set(files.reused), 0, []
        try:
            if files.new:
                self.blocks_dir.mkdir(exist_ok=True)
            for nb in files.new:
                with self.files_lock:  # not while a collector deletes an old copy of it
                    info = self._write_block(nb, tokens, prepared)
                    with self.lock:
                        self.index.add(info)
                        self.index.pin([info.key])
                written += info.nbytes
                pins.add(info.key)
                paths.append(info.path)
            prepared.release()  # the bytes are in the files: fsync needs no view of the pool's buffers
            bytes_out()
            if files.new and self.durable:  # before the manifest that names them (a power loss: checksums tell)
                for p in paths:
                    atomic.fsync_file(p)
                atomic.fsync_path(str(self.blocks_dir))
            path = self.dir / manifest_name(agent_id)
            while True:  # again if save_extra came while this save held the agent: its note goes in too
                with self.lock:
                    extra = self.extras.get(agent_id)
                    self._extra_stale.discard(agent_id)
                m = Manifest(agent_id, self.fingerprint, self.spec, self.bt, tokens, blocks.salt_root,
                             dict(prepared.stored_from), files.extents, extra, snapshots=files.snapshots)
                n = manifest.write(str(path), m, self.durable)
                with self.lock:
                    if agent_id not in self._extra_stale:
                        break
        except BaseException:
            with self.lock:
                self.index.unpin(pins)
            self.collect()
            raise
        return Held(path, n, frozenset(m.keys()), written=written + n, pins=frozenset(pins))

    def _write_block(self, nb: NewBlock, tokens, prepared: cachefile.PreparedSave) -> BlockInfo:
        """One block file, written and renamed but not fsynced (:meth:`write` does, after letting go of the views)."""
        assert not prepared.released, nb
        path = str(self.blocks_dir / blockformat.key_name(nb.key))
        if nb.snapshot:  # the saved buffer of a snapshot group is its snapshot: every tensor whole
            slots = blockformat.snapshot_slots(self.spec, nb.group, nb.end)
            if nb.end == len(tokens):
                have_slots, have_chunks = prepared.slots, prepared.chunks
            else:  # an earlier snapshot of the history
                (snap,) = [p for p in prepared.earlier if (p.group, p.end) == (nb.group, nb.end)]
                have_slots, have_chunks = snap.slots, snap.chunks
            by_name = {s.name: k for k, s in enumerate(have_slots)}
            assert all(have_slots[by_name[s.name]].shape == s.shape for s in slots), nb
            chunks = [have_chunks[by_name[s.name]] for s in slots]
            return blockformat.write(path, self.spec, self.fingerprint, nb.group, nb.parent, nb.block_start, nb.start,
                                   tuple(tokens[nb.block_start:nb.end]), chunks, False, snapshot=True)
        slots = blockformat.block_slots(self.spec, nb.group, nb.end - nb.start)
        by_name = {s.name: k for k, s in enumerate(prepared.slots)}
        chunks = [_slice(prepared.chunks[by_name[s.name]], prepared.slots[by_name[s.name]], nb.buffer, nb.end - nb.start)
                  for s in slots]
        return blockformat.write(path, self.spec, self.fingerprint, nb.group, nb.parent, nb.block_start, nb.start,
                               tuple(tokens[nb.block_start:nb.end]), chunks, False)

    def collect(self) -> int:
        """Delete the block files no manifest names and no save holds; the bytes freed."""
        if self.hold_all:
            return 0
        with self.lock:
            dead = self.index.take_garbage()
        freed = 0
        with self.files_lock:
            for info in dead:
                with self.lock:
                    if info.key in self.index.infos:  # written again since: live
                        continue
                    self.collected += 1
                try:
                    atomic.unlink_quietly(info.path)
                    freed += info.nbytes
                except OSError as exc:  # a read-only directory: the next startup collects it
                    log.warning("cannot delete unused block file %s: %s", info.path, exc)
        return freed

    def evict(self, agent_id: str) -> bool:
        """Delete the agent's manifest (or cache file) and the block files only it used; False when it
        was not indexed.

        Raises:
            OSError: the manifest could not be deleted (it stays indexed).
        """
        with self.lock:
            held = self.entries.get(agent_id)
        if held is None:
            return False
        delete(held.path)
        with self.lock:
            self.pop(agent_id)
            self.extras.pop(agent_id, None)
        self.collect()
        return True

    # ------------------------------------------------------------ loading

    def load(self, agent_id: str, pool: BlockPool, pool_lock: threading.RLock,
             for_ids: Sequence[int] | None = None) -> AgentBlocks | None:
        """The agent's cache read into ``pool`` (the caller holds the agent's lock), or None; a cache
        file of the single-file layout is converted on the way. ``for_ids``: the prompt it is for
        (``blockload.load``: one that extends the history leaves the earlier snapshots on disk).

        Raises:
            PoolExhaustedError: the pool has no room for the blocks it lacks.
        """
        with self.lock:
            held = self.entries.get(agent_id)
            if held is None:
                self.misses += 1
                return None
        if held.legacy:
            return blockscan.convert(self, agent_id, held, pool, pool_lock)
        try:
            m = manifest.read(str(held.path), self.spec, self.fingerprint, self.bt)
        except CacheCorruptError as exc:
            self.refuse(agent_id, held.path, exc.reason)
            return None
        except (CacheMismatchError, CacheFormatError, FileNotFoundError) as exc:
            log.warning("agent %r: cannot load %s: %s", agent_id, held.path, exc)
            self.forget(agent_id)
            return None
        except OSError as exc:
            log.warning("agent %r: cannot read %s: %s", agent_id, held.path, exc)
            with self.lock:
                self.misses += 1
            return None
        if m.agent_id != agent_id:  # replaced behind our back by another agent's manifest
            self.refuse(agent_id, held.path, f"file name does not match its agent id {m.agent_id!r}")
            return None

        def infos():
            with self.lock:
                return dict(self.index.infos)

        release = lambda bl: _locked_release(pool, pool_lock, bl)  # noqa: E731
        blocks = blockload.load(m, infos, pool, pool_lock, self._bad_block, release, for_ids=for_ids)
        if blocks is None:
            with self.lock:
                self.misses += 1
            return None
        self.touched(agent_id)
        if m.extra is not None:
            with self.lock:
                self.extras.setdefault(agent_id, m.extra)
        with contextlib.suppress(OSError):
            os.utime(held.path)  # recency survives a restart
        return blocks

    def load_prefix(self, token_ids, salt_root: int | None, beyond: int, pool: BlockPool,
                    pool_lock: threading.RLock) -> AgentBlocks | None:
        """The longest prefix of ``token_ids`` (its last token left to prefill) that the block files hold,
        whoever saved them, read into ``pool`` when it is longer than ``beyond`` tokens; else None.

        A manifest of the history is planned from the index alone (``BlockIndex.files_for``: the files that hold
        each stretch of it) and loaded as an agent's would be: up to its first missing file, or, for a model
        with snapshot groups, up to the latest position where every such group finds a snapshot file
        (a shared system prompt's end, an earlier turn's boundary)::

            history        [ sys ........ | q1 .......... ]     a new agent after a restart
            on disk        [ agent a's blocks ...
                                    ^ a's snapshot at its system prompt's end
            loaded         [ sys ........ )

        Raises:
            PoolExhaustedError: the pool has no room for the blocks it lacks (nothing taken).
        """
        tokens = tuple(map(int, token_ids[:-1]))
        if len(tokens) <= beyond:
            return None
        chain = chain_keys(tokens, self.bt, salt_root)
        with self.lock:
            chosen = self.index.files_for(self.spec, tokens, chain, salt_root, {}, self.bt)
            files = dict(self.index.infos)
        m = Manifest("", self.fingerprint, self.spec, self.bt, tokens, salt_root, {}, chosen.extents,
                     snapshots=chosen.snapshots)
        if blockload.whole_prefix(m, files, tails=True) <= beyond:
            return None

        def infos():
            with self.lock:
                return dict(self.index.infos)

        release = lambda bl: _locked_release(pool, pool_lock, bl)  # noqa: E731
        return blockload.load(m, infos, pool, pool_lock, self._bad_block, release, tails=True)

    def kept_prefix(self, token_ids, salt_root: int | None) -> tuple[int, str] | None:
        """The longest prefix of ``token_ids`` (its last token left to prefill) kept as an entry of its own
        (:func:`prefix_id`): its length and id, or None."""
        chain = chain_keys(token_ids[:-1], self.bt, salt_root)
        with self.lock:
            for k in range(len(chain) - 1, -1, -1):
                if prefix_id(chain[k]) in self.entries:
                    return (k + 1) * self.bt, prefix_id(chain[k])
        return None

    def _bad_block(self, info: BlockInfo, reason: str) -> None:
        with self.lock:
            self.index.drop(info.key)
            fetched = info.key in self.from_remote
        self.quarantine.set_aside(Path(info.path), reason)
        if fetched and self.on_remote_bad is not None:  # the tier's copy is the same bytes: drop it too
            self.on_remote_bad(info.key)

    def forget(self, agent_id: str) -> None:
        """Drop the agent from the index (its manifest is gone or refused), counting a miss; the block files
        only it used go."""
        super().forget(agent_id)
        self.collect()

    # ------------------------------------------------------------ from another server

    def scan(self) -> None:
        """Index what the directory holds (``blockscan``); raises OSError when it cannot be created or listed."""
        blockscan.scan(self)

    def block_paths(self, keys) -> list[tuple[int, Path]]:
        """``(key, path)`` of the indexed block files among ``keys``."""
        with self.lock:
            return [(k, Path(self.index.infos[k].path)) for k in sorted(keys) if k in self.index.infos]

    # ------------------------------------------------------------ extra documents (the echo note)

    def save_extra(self, agent_id: str, doc: dict) -> bool:
        """Keep a small JSON document in the agent's manifest (rewritten now unless a save of the agent is
        under way: that save, or the next, writes it). The note is a hint, never what makes a reply right, but
        the manifest it rides in is what makes a turn durable: rewritten as durably as a save writes it."""
        try:
            json.dumps(doc)
        except (TypeError, ValueError):
            return False
        with self.lock:
            self.extras[agent_id] = doc
            held = self.entries.get(agent_id)
        lock = self.agent_lock(agent_id)
        if held is not None and held.legacy:
            return True
        if not lock.acquire(blocking=False):  # a save of the agent holds it: that save writes the note
            with self.lock:
                self._extra_stale.add(agent_id)
            return True
        if held is None:  # no manifest yet: the agent's first save writes the note
            lock.release()
            return True
        try:
            m = manifest.read(str(held.path), self.spec, self.fingerprint, self.bt)
            # durable as a save is: the manifest is what makes a turn durable, and the note rides in it
            n = manifest.write(str(held.path), _with_extra(m, doc), durable=self.durable)
            with self.lock:
                if self.entries.get(agent_id) is held:
                    held.nbytes = n
            return True
        except (OSError, CacheCorruptError, CacheMismatchError, CacheFormatError) as exc:
            log.debug("agent %r: extra document not written: %s", agent_id, exc)
            return False
        finally:
            lock.release()

    def load_extra(self, agent_id: str) -> dict | None:
        with self.lock:
            doc = self.extras.get(agent_id)
            held = self.entries.get(agent_id)
        if doc is not None or held is None:
            return doc
        if held.legacy:
            return blockscan.read_json(str(held.path) + EXTRA_SUFFIX)
        try:
            return manifest.read(str(held.path), self.spec, self.fingerprint, self.bt).extra
        except (OSError, CacheCorruptError, CacheMismatchError, CacheFormatError):
            return None

    # ------------------------------------------------------------ startup

def _with_extra(m: Manifest, doc: dict) -> Manifest:
    return Manifest(m.agent_id, m.model_fingerprint, m.spec, m.block_tokens, m.token_ids, m.hash_root, m.stored_from,
                    m.extents, doc, snapshots=m.snapshots)


def _earlier_ends(prepared: cachefile.PreparedSave) -> dict[str, list[int]]:
    """Per snapshot group, the ends of the snapshots a save carries before its last (ascending)."""
    out: dict[str, list[int]] = {}
    for p in prepared.earlier:
        out.setdefault(p.group, []).append(p.end)
    return out


def _snapshot_bytes(spec: ModelCacheSpec, nb: NewBlock) -> int:
    """The tensor bytes of a snapshot file."""
    return sum(s.nbytes for s in blockformat.snapshot_slots(spec, nb.group, nb.end))


def _slice(chunks: list[memoryview], slot, first: int, n: int) -> list[memoryview]:
    """File-order bytes of rows ``[first, first + n)`` of a saved tensor given as :func:`cachefile.prepare_save`
    chunks (per head, the runs of arrays that hold its rows)."""
    heads = slot.shape[1]
    row = slot.shape[3] * ST_DTYPES[slot.dtype][1]
    per_head = len(chunks) // heads
    rows = [chunks[j].nbytes // row for j in range(per_head)]
    out = []
    for h in range(heads):
        at = 0
        for j, r in enumerate(rows):
            lo, hi = max(at, first), min(at + r, first + n)
            if lo < hi:
                out.append(chunks[h * per_head + j][(lo - at) * row:(hi - at) * row])
            at += r
    return out


def _locked_release(pool: BlockPool, pool_lock, blocks) -> None:
    with pool_lock:
        pool.release(blocks)
