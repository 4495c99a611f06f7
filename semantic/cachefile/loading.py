"""Loading a cache file into a block pool (see ``fileformat`` for the layout).

A load checks the header against the layout the document implies and the
file size, and every tensor it reads against its checksum, before any block
reaches the pool; anything wrong raises :class:`CacheCorruptError`. Nothing
is ever unpickled. It goes through the pool's hash-chained lookup
(``blockclaim``): full blocks the pool already holds are shared and their
tensors are not even read. Each group's tensors become one segment
(``blocks.Segment``) that the loaded blocks are views of, so reconstruction
hands it over without a copy.
"""

from __future__ import annotations

import os
from collections import Counter
from contextlib import AbstractContextManager, nullcontext
from typing import Iterable

import mlx.core as mx
import xxhash

from semantic.cache.blockclaim import BlockClaim, ClaimedBlock, chain_keys, commit, miss_runs, claim_blocks, stored_ranges
from semantic.cache.blocks import AgentBlocks, KVBlock, LayerKV, Segment, SegmentView
from semantic.cachefile.atomic import hasher
from semantic.cachefile.fileformat import HASH, MX_DTYPES, CacheFileInfo, TensorSlot, read_header
from semantic.errors import CacheCorruptError, CacheMismatchError
from semantic.cache.pool import BlockPool


class _Replaced(Exception):
    """The file at the path changed between reading its header and its data."""


def _read_tensors(info: CacheFileInfo, slots: list[TensorSlot]) -> dict[str, mx.array]:
    """The slots' tensors, evaluated and checked against their checksums.

    ``mx.load`` reads straight into the arrays' memory, with no Python-side
    buffer and no copy, in one ``mx.eval``: MLX reads the tensors in parallel
    only when it is given all of them (evaluating them in groups, to hash each
    while it is still in cache, measured 1.2-1.9x slower). The calling thread
    then hashes its share beside the hashing threads instead of waiting for
    them (xxhash releases the GIL).
    """
    if not slots:
        return {}
    try:
        loaded = mx.load(info.path)
    except (RuntimeError, ValueError, OSError, IndexError) as exc:  # mlx 0.30 raises IndexError on some headers
        raise CacheCorruptError(info.path, f"mx.load failed: {exc}") from None
    st = os.stat(info.path)
    if (st.st_dev, st.st_ino) != info.inode:
        raise _Replaced
    tensors = {}
    for s in slots:
        t = loaded.get(s.name)
        if t is None or tuple(t.shape) != s.shape or t.dtype != MX_DTYPES[s.dtype]:
            raise CacheCorruptError(info.path, f"tensor {s.name} does not load as {s.shape} {s.dtype}")
        tensors[s.name] = t
    names, arrays = list(tensors), list(tensors.values())
    try:
        mx.eval(arrays)
    except (RuntimeError, ValueError) as exc:  # e.g. the file shrank under us
        raise CacheCorruptError(info.path, f"reading tensors failed: {exc}") from None
    # every (workers + 1)-th tensor per thread: keys and values alternate, so the shares weigh alike
    shares = 1 + min(hasher()._max_workers, max(1, (os.cpu_count() or 2) - 1))
    pending = [hasher().submit(_digest_arrays, arrays[k::shares]) for k in range(1, shares)]
    digests = [_digest_arrays(arrays[0::shares])] + [f.result() for f in pending]
    for k, got in enumerate(digests):
        for name, d in zip(names[k::shares], got):
            if d != info.digests[name]:
                raise CacheCorruptError(info.path, f"tensor {name}: checksum mismatch ({HASH} {d} != {info.digests[name]})")
    return tensors


def _digest_arrays(arrays: list[mx.array]) -> list[str]:
    return [xxhash.xxh3_128(_bytes(a)).hexdigest() for a in arrays]


def _bytes(a: mx.array) -> memoryview:
    """The raw bytes of an evaluated, row-contiguous array, without a copy."""
    if a.size == 0:  # a zero-wide tensor (deepseek_v32's indexer values) holds no bytes
        return memoryview(b"")
    mv = memoryview(a)
    assert mv.c_contiguous, "only row-contiguous arrays have one byte view"
    return mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv


class _FileBlocks:
    """A file's tensors, served as the pool's blocks of any size.

    Each group's per-layer arrays form one segment, and a missed block is a
    view of it. When some of a group's blocks hit the pool instead, each run
    of missed blocks is copied into a segment of its own, so the shared
    tokens' bytes are not kept alive twice.
    """

    def __init__(self, info: CacheFileInfo):
        self.info = info
        self.by_group: dict[str, list[TensorSlot]] = {}
        self.by_layer: dict[int, dict[tuple[str, int | None], str]] = {}  # layer -> (side, part) -> tensor name
        for s in info.slots:
            self.by_group.setdefault(s.group, []).append(s)
            self.by_layer.setdefault(s.layer, {})[(s.side, s.part)] = s.name
        self.arrays: dict[str, mx.array] = {}

    def needed(self, planned: Iterable[ClaimedBlock]) -> list[TensorSlot]:
        """Unread tensors of every group with a block that missed the pool."""
        groups = {p.group for p in planned if p.hit is None}
        return [s for g, slots in self.by_group.items() if g in groups for s in slots if s.name not in self.arrays]

    def read(self, slots: list[TensorSlot]) -> None:
        self.arrays.update(_read_tensors(self.info, slots))

    def layer(self, i: int) -> LayerKV:
        """Layer ``i``'s (keys, values) over every token its group holds (tensors are keyed by layer)."""
        names, a = self.by_layer[i], self.arrays
        if ("keys", None) in names:
            return a[names[("keys", None)]], a[names[("values", None)]]
        return tuple(tuple(a[names[(side, k)]] for k in range(3)) for side in ("keys", "values"))

    def snapshot(self, i: int, total: int) -> LayerKV:
        """Layer ``i``'s snapshot after ``total`` tokens (the file's): the positions it holds then, cut out
        of the buffer, which may start earlier (``stored_from``: a window edge stored with its block)."""
        layer = self.info.spec.layers[i]
        held = layer.held_ranges(total)
        stored = stored_ranges(layer, total, self.info.stored_from.get(layer.group))
        kv, cuts, at = self.layer(i), [], 0
        for (a, b), (sa, sb) in zip(held, stored):
            cuts.append((at + a - sa, at + b - sa))
            at += sb - sa
        if cuts == [(0, at)]:
            return kv  # the buffer is the window: no copy
        return _map(kv, lambda x: mx.contiguous(mx.concatenate([x[..., p:q, :] for p, q in cuts], axis=2)))

    def block_data(self, planned: BlockClaim) -> dict[int, tuple[dict[int, LayerKV], SegmentView]]:
        """For each missed planned block (by index): its own layer data (a snapshot: its layers' whole
        window) or where it sits in its segment."""
        out, made = {}, []
        per_group = Counter(p.group for p in planned.blocks)
        for run in miss_runs(planned.blocks):
            first, last = planned.blocks[run[0]], planned.blocks[run[-1]]
            if first.snapshot:  # a window shorter than a block: the file's window after its last token
                data = {i: self.snapshot(i, first.end) for i in first.layers}
                made.extend(_leaves(list(data.values())))
                out[run[0]] = (data, None)
                continue
            lo, hi = first.start - first.shift, last.end - last.shift
            n = next(s.shape[2] for s in self.by_group[first.group])
            whole = len(run) == per_group[first.group] and lo == 0 and hi == n
            seg = Segment({}, hi - lo)
            for i in first.layers:
                kv = self.layer(i)
                # all of the group: the file's arrays are the segment (no copy)
                seg.layer_data[i] = kv if whole else _map(kv, lambda x: mx.contiguous(x[..., lo:hi, :]))
            made.extend(_leaves(list(seg.layer_data.values())))
            for idx in run:
                out[idx] = ({}, SegmentView(seg, planned.blocks[idx].start - planned.blocks[idx].shift - lo))
        # the segments (after a partial hit, copies), evaluated on the loading thread: mlx 0.32 refuses
        # to evaluate an array on another thread than the one that made it. One flat list of arrays
        # evaluates 1.4-1.6x faster than the nested per-block dicts (1920 views: 5.1 ms against 7.2)
        mx.eval(made)
        return out


def _map(kv: LayerKV, fn) -> LayerKV:
    return tuple(tuple(fn(x) for x in side) if isinstance(side, tuple) else fn(side) for side in kv)


def _leaves(pieces: list[LayerKV]) -> list[mx.array]:
    return [x for kv in pieces for side in kv for x in (side if isinstance(side, tuple) else (side,))]


def load(
    path: str | os.PathLike,
    pool: BlockPool,
    *,
    model_fingerprint: str | None = None,
    lock: AbstractContextManager | None = None,
) -> AgentBlocks:
    """Load a cache file into ``pool`` as one agent's blocks.

    Full blocks already in the pool (the same tokens under the same chained
    key) are shared, not read: only the tensors of blocks that miss are read
    and checksummed. The pool is changed only once every read tensor has
    been verified, and not at all when this raises.

    Args:
        path: a file written by ``save``.
        pool: the pool to load into; its spec must be the file's.
        model_fingerprint: when given, the file must have been written for it.
        lock: held around every use of ``pool`` (not around file reads),
            for callers that share the pool between threads.

    Raises:
        CacheCorruptError: the file is damaged in any way.
        CacheMismatchError: the file belongs to another model or cache spec.
        PoolExhaustedError: the pool cannot hold the blocks that missed.
        FileNotFoundError: there is no file at ``path``.
    """
    for _ in range(3):
        try:
            return _load_once(os.fspath(path), pool, model_fingerprint, lock or nullcontext())
        except _Replaced:
            continue  # a writer renamed a new file over it meanwhile: read the new one
    raise CacheCorruptError(path, "the file kept being replaced while it was loading")


def _load_once(path: str, pool: BlockPool, fingerprint: str | None, lock: AbstractContextManager) -> AgentBlocks:
    info = read_header(path)
    pool.spec.require_same(info.spec, f"cache file {path}")
    if fingerprint is not None and info.model_fingerprint != fingerprint:
        raise CacheMismatchError(
            f"cache file {path} was written for model {info.model_fingerprint!r}, not {fingerprint!r}"
        )
    source = _FileBlocks(info)
    chain = chain_keys(info.token_ids, pool.block_tokens, info.hash_root)  # re-keyed under its own salt
    with lock:
        planned = claim_blocks(pool, info.spec, info.token_ids, chain, info.hash_root, info.stored_from)
    source.read(source.needed(planned.blocks))  # the slow part, outside the lock
    with lock:
        planned = claim_blocks(pool, info.spec, info.token_ids, chain, info.hash_root, info.stored_from)
        late = source.needed(planned.blocks)  # hits that were recycled meanwhile
        if late:
            source.read(late)
        data = source.block_data(planned)
        by_block = {id(p): data[idx] for idx, p in enumerate(planned.blocks) if idx in data}
        release = pool.release if isinstance(lock, nullcontext) else _locked(pool.release, lock)
        return commit(
            pool, info.spec, info.token_ids, planned, lambda p: by_block[id(p)], release=release, salt_root=info.hash_root
        )


def _locked(fn, lock: AbstractContextManager):
    def call(blocks: list[KVBlock]) -> None:
        with lock:
            fn(blocks)

    return call
