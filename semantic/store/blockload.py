"""Loading an agent's cache from its manifest: the pool first, then only the block files it lacks.

::

    manifest ─► extents per group ─► which prefix is whole on disk (files indexed, each fitting the history)
             ─► plan against the pool (``blockplan``): pooled blocks are shared, never read
             ─► read the files of the missed blocks (``mx.load``, one eval), verify every checksum
             ─► commit: a missed block made of one whole file holds its arrays (no copy)

A block file that fails its checksum is handed to ``on_bad`` (the store
quarantines it) and the load starts again without it: the agent resumes
from the blocks before it, and the turn prefills the rest. A history cut
short must still hold every group's window at the cut, else the load misses.

A group that resumes only from a snapshot (``manifest``: ``snapshots``) loads
from its snapshot file after the whole history, and from nothing else of the
manifest; the snapshots it lists before that (where a regenerate resumes) are
loaded too, as earlier snapshot blocks of the same group (``blockplan.commit``'s
``earlier``), each from the pool when it holds it, else from its file; one whose
file is damaged or lost is left out, and only it. When the last snapshot file,
or a positional block before the end, is lost, the history resumes where every
such group finds a snapshot file on disk of a prefix of it (the agent's own
earlier snapshots; another agent's: a shared system prompt's, an earlier
branch's) that the other groups' extents also cover; else it misses::

    history           [ sys ........ | q1 a1 ............ | q2 ..... ]
    snapshot files           ^ agent b's (its history ends there)      ^ ours: damaged
    resumes from             ^ (global blocks cover [0, sys))

A manifest written before snapshots holds a short window's positions; its
snapshot is assembled from them (``_block_data``), at any prefix they cover.
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Callable

import mlx.core as mx

from semantic.cache.blockplan import PlannedBlock, chain_keys, commit, plan_blocks, snapshot_span
from semantic.cache.blocks import AgentBlocks, LayerKV
from semantic.cachefile.atomic import hasher
from semantic.cachefile.loading import _digest_arrays
from semantic.errors import CacheCorruptError
from semantic.cache.pool import BlockPool
from semantic.store import blockformat
from semantic.store.blockformat import BlockInfo
from semantic.cache.spec import RECURRENT
from semantic.store.manifest import Extent, Manifest

log = logging.getLogger(__package__)


def whole_prefix(m: Manifest, infos: dict[int, BlockInfo]) -> int:
    """The longest history prefix (the whole history, or a block boundary) every group can load
    from the files indexed now; 0 when none (see the module doc for snapshot groups)."""
    return _prefix(m, infos)[0]


def _prefix(m: Manifest, infos: dict[int, BlockInfo]) -> tuple[int, Manifest]:
    """:func:`whole_prefix`, and the manifest to load it with: ``m`` less the earlier snapshots whose files
    are not whole, or (a prefix) that with each snapshot group's last extent naming the snapshot file
    found at that prefix, after the group's earlier snapshots before it."""
    bt, chain = m.block_tokens, chain_keys(m.token_ids, m.block_tokens, m.hash_root)
    good: dict[str, list[tuple[int, int]]] = {}
    bad = m.total_tokens
    lost = False  # a snapshot file of the whole history
    whole: dict[str, tuple[Extent, ...]] = {}  # per snapshot group, its extents whose files are whole
    for g, extents in m.extents.items():
        if g in m.snapshots:
            whole[g] = tuple(e for e in extents if _fits_snapshot(infos.get(e.key), g, m, chain)
                             and e.end == infos[e.key].end)
            lost = lost or not (whole[g] and whole[g][-1].end == m.total_tokens)
            continue
        cover = good[g] = []
        for e in extents:
            if not _fits(e, infos.get(e.key), g, m, chain):
                bad = min(bad, e.start)
                break
            if cover and cover[-1][1] == e.start:
                cover[-1] = (cover[-1][0], e.end)
            else:
                cover.append((e.start, e.end))
    if bad == m.total_tokens and not lost:
        return bad, replace(m, extents={**m.extents, **whole}) if whole else m
    positional = [(g, m.spec.layers[layers[0]]) for g, layers in m.spec.groups().items() if g not in m.snapshots]
    if m.snapshots:
        # the latest prefix where every snapshot group finds a whole file (the agent's own earlier snapshots
        # first among equals: they are indexed like any other) and the positional extents cover it
        at = _snapshots_on_disk(m, infos, chain, bad if not lost else min(bad, m.total_tokens - 1))
        for total in sorted(at, reverse=True):
            if all(_covered(layer.held_ranges(total), good[g]) for g, layer in positional):
                return total, replace(m, extents={**m.extents, **{
                    g: (*(e for e in whole[g] if e.end < total), Extent(key, info_start, total))
                    for g, (key, info_start) in at[total].items()}})
        return 0, m
    for total in range(bad - bad % bt, 0, -bt):
        if all(_covered(layer.held_ranges(total), good[g]) for g, layer in positional):
            return total, m
    return 0, m


def _snapshots_on_disk(m: Manifest, infos: dict[int, BlockInfo], chain: list[int], upto: int) -> dict:
    """Per prefix length ``t <= upto``, the snapshot file of each snapshot group after the history's
    first ``t`` tokens, ``{t: {group: (key, block start)}}``, for the ``t`` where every group has one."""
    at: dict[int, dict[str, tuple[int, int]]] = {}
    for info in infos.values():
        if info.snapshot and info.group in m.snapshots and info.end <= upto and _fits_snapshot(info, info.group, m, chain):
            at.setdefault(info.end, {})[info.group] = (info.key, info.start)
    return {t: got for t, got in at.items() if len(got) == len(m.snapshots)}


def _fits_snapshot(info: BlockInfo | None, group: str, m: Manifest, chain: list[int]) -> bool:
    """Whether ``info`` is a snapshot of ``group`` after a prefix of ``m``'s history (all its tokens match)."""
    if info is None or not info.snapshot or info.group != group or info.end > m.total_tokens:
        return False
    bs = info.block_start
    if (bs, info.end) != snapshot_span(info.end, m.block_tokens):
        return False
    parent = chain[bs // m.block_tokens - 1] if bs else m.hash_root
    return info.usable_end(m.token_ids[bs:info.end], parent, info.end) == info.end


def _fits(e: Extent, info: BlockInfo | None, group: str, m: Manifest, chain: list[int]) -> bool:
    if info is None or info.snapshot or info.group != group or not info.start <= e.start < e.end <= info.end:
        return False
    bs = info.block_start
    parent = chain[bs // m.block_tokens - 1] if bs else m.hash_root
    return info.usable_end(m.token_ids[bs:e.end], parent, e.end) >= e.end


def _covered(ranges, cover) -> bool:
    return all(any(a <= x and y <= b for a, b in cover) for x, y in ranges if y > x)


def load(m: Manifest, infos: Callable[[], dict[int, BlockInfo]], pool: BlockPool, pool_lock: AbstractContextManager,
         on_bad: Callable[[BlockInfo, str], None], release) -> AgentBlocks | None:
    """``m``'s cache (or its longest whole prefix) in ``pool``; None when nothing of it loads.

    Args:
        infos: the indexed block files now (a fresh view each try).
        on_bad: called with a file that failed its checks, and why.
        release: what the returned blocks call to go back to the pool (under ``pool_lock``).

    Raises:
        PoolExhaustedError: the pool cannot hold the blocks that missed (nothing taken).
    """
    for _ in range(8):
        files = infos()
        total, at = _prefix(m, files)
        if total == 0:
            return None
        try:
            return _load_prefix(at, total, files, pool, pool_lock, release)
        except _Bad as bad:
            on_bad(bad.info, bad.reason)
        except _Unreadable as exc:  # a miss this time; the files stay
            log.warning("agent %r: a block file could not be read: %s", m.agent_id, exc)
            return None
    return None


class _Unreadable(Exception):
    """A block file could not be read now; nothing is known to be wrong with it."""


class _Bad(Exception):
    def __init__(self, info: BlockInfo, reason: str):
        self.info, self.reason = info, reason


def _load_prefix(m: Manifest, total: int, files, pool, pool_lock, release) -> AgentBlocks:
    tokens = m.token_ids[:total]
    stored_from = m.stored_from if total == m.total_tokens else {}
    chain = chain_keys(tokens, m.block_tokens, m.hash_root)

    def plans():
        planned = plan_blocks(pool, m.spec, tokens, chain, m.hash_root, stored_from)
        return planned, _earlier_plans(m, total, pool, chain)

    with pool_lock:
        planned, earlier = plans()
    arrays: dict[int, dict[str, mx.array]] = {}
    _read(_needed(m, [*planned.blocks, *earlier], arrays), files, arrays)  # the slow part, outside the lock
    with pool_lock:
        planned, earlier = plans()
        _read(_needed(m, [*planned.blocks, *earlier], arrays), files, arrays)  # hits recycled meanwhile
        data = {_where(p): _block_data(m, p, files, arrays) for p in (*planned.blocks, *earlier) if p.hit is None}
        made = [x for layers in data.values() for kv in layers.values() for side in kv
                for x in (side if isinstance(side, tuple) else (side,))]
        mx.eval(made)
        if not earlier:
            return commit(pool, m.spec, tokens, planned, lambda p: (data[_where(p)], None), release=release,
                          salt_root=m.hash_root)
        # room for all first (nothing taken when there is none); then every hit is held here, so making the
        # earlier snapshots' blocks recycles none of them, and commit takes the earlier ones with the rest
        pool.require_free(planned.need + sum(pool.cost(p.group) for p in earlier if p.hit is None or pool.is_free(p.hit)))
        held = [pool.acquire(p.hit) for p in (*planned.blocks, *earlier) if p.hit is not None]
        try:
            mine = [p.hit if p.hit is not None else pool.allocate(
                p.group, p.start, tokens[p.start:p.end], data[_where(p)], p.key, parent=p.parent) for p in earlier]
            held += [b for b, p in zip(mine, earlier) if p.hit is None]
            planned = plan_blocks(pool, m.spec, tokens, chain, m.hash_root, stored_from)  # fresh: the hits held
            return commit(pool, m.spec, tokens, planned, lambda p: (data[_where(p)], None), release=release,
                          salt_root=m.hash_root, earlier=mine)
        finally:
            pool.release(held)


def _where(p: PlannedBlock) -> tuple:
    """A planned block's place, the same in a fresh plan of the same history."""
    return p.group, p.start, p.end, p.snapshot


def _earlier_plans(m: Manifest, total: int, pool: BlockPool, chain) -> list[PlannedBlock]:
    """The snapshot blocks of the manifest's snapshots before ``total`` (``m``'s snapshot groups' earlier
    extents), planned as ``plan_blocks`` plans a snapshot after their end: pooled ones hit, never read."""
    bt, out = m.block_tokens, []
    by_end: dict[int, set[str]] = {}
    for g in m.snapshots:
        for e in m.extents[g]:
            if e.end < total:
                by_end.setdefault(e.end, set()).add(g)
    for end, groups in sorted(by_end.items()):
        planned = plan_blocks(pool, m.spec, m.token_ids[:end], chain[: end // bt], m.hash_root)
        out.extend(p for p in planned.blocks if p.snapshot and p.group in groups)
    return out


def _overlapping(m: Manifest, group: str, a: int, b: int) -> list[Extent]:
    return [e for e in m.extents[group] if e.start < b and a < e.end]


def _snapshot_extent(m: Manifest, p) -> Extent:
    """The extent of the snapshot file after ``p.end`` tokens, of ``p``'s group."""
    (e,) = [e for e in m.extents[p.group] if e.end == p.end]
    return e


def _extents(m: Manifest, p) -> list[Extent]:
    """The extents a missed planned block reads: its positions' (a snapshot of a manifest written before
    snapshots: the positions its window holds then; of a later one: its snapshot file)."""
    if p.snapshot and p.group not in m.snapshots:
        layer = m.spec.layers[p.layers[0]]
        return [e for a, b in layer.held_ranges(p.end) for e in _overlapping(m, p.group, a, b)]
    if p.snapshot:
        return [_snapshot_extent(m, p)]
    return _overlapping(m, p.group, p.start, p.end)


def _needed(m: Manifest, planned, arrays) -> set[int]:
    return {e.key for p in planned if p.hit is None for e in _extents(m, p) if e.key not in arrays}


def _read(keys: set[int], files: dict[int, BlockInfo], arrays: dict) -> None:
    """The files' tensors, evaluated together and verified (raises :class:`_Bad` for the first that fails)."""
    if not keys:
        return
    loaded = {}
    for k in keys:
        try:
            loaded[k] = blockformat.load_arrays(files[k])
        except CacheCorruptError as exc:
            raise _Bad(files[k], exc.reason) from None
        except OSError as exc:  # gone or unreadable now (permissions, too many open files): no verdict on it
            raise _Unreadable(f"{files[k].path}: {exc}") from None
    flat = [(k, name, a) for k, t in loaded.items() for name, a in t.items()]
    try:
        mx.eval([a for _, _, a in flat])
    except (RuntimeError, ValueError, IndexError):  # one file read short (shrank under us): find which, one by one
        for k, t in loaded.items():
            try:
                mx.eval(list(t.values()))
            except (RuntimeError, ValueError, IndexError) as exc:
                raise _Bad(files[k], f"reading tensors failed: {exc}") from None
        raise _Unreadable("reading block files failed, and each alone read") from None
    shares = 1 + min(hasher()._max_workers, max(1, (os.cpu_count() or 2) - 1))
    arrs = [a for _, _, a in flat]
    pending = [hasher().submit(_digest_arrays, arrs[i::shares]) for i in range(1, shares)]
    digests = [_digest_arrays(arrs[0::shares])] + [f.result() for f in pending]
    for i, got in enumerate(digests):
        for (k, name, _), d in zip(flat[i::shares], got):
            if d != files[k].digests[name]:
                raise _Bad(files[k], f"tensor {name}: checksum mismatch")
    arrays.update(loaded)


def _block_data(m: Manifest, p, files, arrays) -> dict[int, LayerKV]:
    """A missed planned block's K/V per layer, from the files its extents name."""
    if p.snapshot:
        return _snapshot_data(m, p, files, arrays)
    parts = []
    for e in _overlapping(m, p.group, p.start, p.end):
        info = files[e.key]
        lo, hi = max(e.start, p.start) - info.start, min(e.end, p.end) - info.start
        parts.append((arrays[e.key], lo, hi, hi - lo == info.end - info.start))
    assert sum(hi - lo for _, lo, hi, _ in parts) == p.end - p.start, (p.start, p.end)
    direct = len(parts) == 1 and parts[0][3]  # one whole file: its arrays are the block's, no copy
    out = {}
    for i in p.layers:
        sides = []
        for side in ("keys", "values"):
            names = [n for n in (f"layer.{i}.{side}",) if n in parts[0][0]] or [
                f"layer.{i}.{side}.{q}" for q in ("packed", "scales", "biases")]
            pieces = [_join([_cut(t[n], lo, hi, whole) for t, lo, hi, whole in parts], direct) for n in names]
            sides.append(pieces[0] if len(names) == 1 else tuple(pieces))
        out[i] = tuple(sides)
    return out


def _snapshot_data(m: Manifest, p, files, arrays) -> dict[int, LayerKV]:
    """A snapshot block's layers in the pool's format (``convert``): a recurrent layer's ``(arrays, ())``,
    a short window's ``(keys, values)`` of the tokens it holds after ``p.end``, in temporal order."""
    if p.group in m.snapshots:
        e = _snapshot_extent(m, p)
        info, t = files[e.key], arrays[e.key]
        assert info.snapshot and (info.start, info.end) == (p.start, p.end), (info, p)
        out = {}
        for i in p.layers:
            layer = m.spec.layers[i]
            if layer.kind == RECURRENT:
                out[i] = (tuple(t[f"layer.{i}.state.{j}"] for j in range(len(layer.arrays))), ())
            else:
                out[i] = (t[f"layer.{i}.keys"], t[f"layer.{i}.values"])
        return out
    # a manifest written before snapshots: the window's positions, cut out of its positional files
    layer = m.spec.layers[p.layers[0]]
    parts = []
    for a, b in layer.held_ranges(p.end):
        for e in _overlapping(m, p.group, a, b):
            info = files[e.key]
            lo, hi = max(e.start, a) - info.start, min(e.end, b) - info.start
            parts.append((arrays[e.key], lo, hi))
    assert sum(hi - lo for _, lo, hi in parts) == layer.tokens_held(p.end), (p.start, p.end)
    return {i: tuple(_join([t[f"layer.{i}.{side}"][..., lo:hi, :] for t, lo, hi in parts], False)
                     for side in ("keys", "values")) for i in p.layers}


def _cut(x: mx.array, lo: int, hi: int, whole: bool) -> mx.array:
    return x if whole else x[..., lo:hi, :]


def _join(xs: list[mx.array], direct: bool) -> mx.array:
    if direct:
        return xs[0]
    return mx.contiguous(xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=2))
