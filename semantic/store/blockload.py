"""Loading an agent's cache from its manifest: the pool first, then only the block files it lacks.

::

    manifest ─► extents per group ─► which prefix is whole on disk (files indexed, each fitting the history)
             ─► plan against the pool (``blockclaim``): pooled blocks are shared, never read
             ─► per run of missed blocks of a group, one array per layer and part sized for the run (a segment);
                its files read straight into their rows, each tensor hashed as it arrives (``blockread``)
             ─► commit: the run's blocks are views of its segment, so a layer reconstructs with no copy

A block file that fails its checksum is handed to ``on_bad`` (the store
quarantines it) and the load starts again without it: the agent resumes
from the blocks before it, and the turn prefills the rest. A history cut
short must still hold every group's window at the cut, else the load misses.

A group that resumes only from a snapshot (``manifest``: ``snapshots``) loads
from its snapshot file after the whole history, and from nothing else of the
manifest; the snapshots it lists before that (where a regenerate resumes) are
loaded too, as earlier snapshot blocks of the same group (``blockclaim.commit``'s
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
snapshot is assembled from them (``_snapshot_fill``), at any prefix they cover.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Callable, Sequence

import mlx.core as mx

from semantic import heap, kinds
from semantic.cache import lending
from semantic.cache.blockclaim import ClaimedBlock, chain_keys, commit, claim_blocks, snapshot_span
from semantic.cache.blocks import AgentBlocks, LayerKV, Segment, SegmentView
from semantic.cachefile.fileformat import MX_DTYPES, QPARTS
from semantic.errors import CacheCorruptError
from semantic.cache.pool import BlockPool
from semantic.store import blockformat, blockread
from semantic.store.blockformat import BlockInfo
from semantic.cache.spec import RECURRENT
from semantic.store.manifest import Extent, Manifest

log = logging.getLogger(__package__)


def whole_prefix(m: Manifest, infos: dict[int, BlockInfo], tails: bool = False) -> int:
    """The longest history prefix (the whole history, or a block boundary; with ``tails``, also where
    the files stop mid-block) every group can load from the files indexed now; 0 when none (see the
    module doc for snapshot groups)."""
    return _prefix(m, infos, tails)[0]


def _prefix(m: Manifest, infos: dict[int, BlockInfo], tails: bool = False) -> tuple[int, Manifest]:
    """:func:`whole_prefix`, and the manifest to load it with: ``m`` less the earlier snapshots whose files
    are not whole, or (a prefix) that with each snapshot group's last extent naming the snapshot file
    found at that prefix, after the group's earlier snapshots before it. ``tails``: a model without
    snapshot groups may also stop where its files stop mid-block (another agent's history, which
    shares a system prompt with this one, leaves its block file there)."""
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
    for total in [bad] * (tails and bad % bt > 0) + list(range(bad - bad % bt, 0, -bt)):
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
         on_bad: Callable[[BlockInfo, str], None], release, tails: bool = False,
         for_ids: Sequence[int] | None = None) -> AgentBlocks | None:
    """``m``'s cache (or its longest whole prefix) in ``pool``; None when nothing of it loads.

    Args:
        infos: the indexed block files now (a fresh view each try).
        on_bad: called with a file that failed its checks, and why.
        release: what the returned blocks call to go back to the pool (under ``pool_lock``).
        for_ids: the prompt of the turn the load is for, when known. A prompt that extends the loaded
            history resumes from its last snapshot, and its turn carries only that one on: the earlier
            snapshots (where a regenerate resumes) stay on disk, neither read nor held.

    Raises:
        PoolExhaustedError: the pool cannot hold the blocks that missed (nothing taken).
    """
    for _ in range(8):
        files = infos()
        total, at = _prefix(m, files, tails)
        if total == 0:
            return None
        try:
            return _load_prefix(at, total, files, pool, pool_lock, release, not _extends(for_ids, at.token_ids[:total]))
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


def _extends(ids: Sequence[int] | None, history: Sequence[int]) -> bool:
    """Whether the prompt ``ids`` is ``history`` and more (a turn that resumes from its end)."""
    return ids is not None and len(ids) > len(history) and tuple(ids[:len(history)]) == tuple(history)


def _load_prefix(m: Manifest, total: int, files, pool, pool_lock, release, earlier_too: bool = True) -> AgentBlocks:
    tokens = m.token_ids[:total]
    stored_from = m.stored_from if total == m.total_tokens else {}
    chain = chain_keys(tokens, m.block_tokens, m.hash_root)

    def plans():
        planned = claim_blocks(pool, m.spec, tokens, chain, m.hash_root, stored_from)
        return planned, _earlier_plans(m, total, pool, chain) if earlier_too else []

    with pool_lock:
        planned, earlier = plans()
    got: dict[tuple, tuple[dict[int, LayerKV], SegmentView | None]] = {}
    _restore(m, [*planned.blocks, *earlier], files, got, total)  # the slow part, outside the lock
    with pool_lock:
        planned, earlier = plans()
        _restore(m, [*planned.blocks, *earlier], files, got, total)  # hits recycled meanwhile
        if not earlier:
            return commit(pool, m.spec, tokens, planned, lambda p: got[_where(p)], release=release,
                          salt_root=m.hash_root)
        # room for all first (nothing taken when there is none); then every hit is held here, so making the
        # earlier snapshots' blocks recycles none of them, and commit takes the earlier ones with the rest
        pool.require_free(planned.need + sum(pool.cost(p.group) for p in earlier if p.hit is None or pool.is_free(p.hit)))
        held = [pool.acquire(p.hit) for p in (*planned.blocks, *earlier) if p.hit is not None]
        try:
            mine = [p.hit if p.hit is not None else pool.allocate(
                p.group, p.start, tokens[p.start:p.end], got[_where(p)][0], p.key, parent=p.parent) for p in earlier]
            held += [b for b, p in zip(mine, earlier) if p.hit is None]
            planned = claim_blocks(pool, m.spec, tokens, chain, m.hash_root, stored_from)  # fresh: the hits held
            return commit(pool, m.spec, tokens, planned, lambda p: got[_where(p)], release=release,
                          salt_root=m.hash_root, earlier=mine)
        finally:
            pool.release(held)


def _where(p: ClaimedBlock) -> tuple:
    """A planned block's place, the same in a fresh plan of the same history."""
    return p.group, p.start, p.end, p.snapshot


def _earlier_plans(m: Manifest, total: int, pool: BlockPool, chain) -> list[ClaimedBlock]:
    """The snapshot blocks of the manifest's snapshots before ``total`` (``m``'s snapshot groups' earlier
    extents), planned as ``claim_blocks`` plans a snapshot after their end: pooled ones hit, never read."""
    bt, out = m.block_tokens, []
    by_end: dict[int, set[str]] = {}
    for g in m.snapshots:
        for e in m.extents[g]:
            if e.end < total:
                by_end.setdefault(e.end, set()).add(g)
    for end, groups in sorted(by_end.items()):
        planned = claim_blocks(pool, m.spec, m.token_ids[:end], chain[: end // bt], m.hash_root)
        out.extend(p for p in planned.blocks if p.snapshot and p.group in groups)
    return out


def _overlapping(m: Manifest, group: str, a: int, b: int) -> list[Extent]:
    return [e for e in m.extents[group] if e.start < b and a < e.end]


def _snapshot_extent(m: Manifest, p) -> Extent:
    """The extent of the snapshot file after ``p.end`` tokens, of ``p``'s group."""
    (e,) = [e for e in m.extents[p.group] if e.end == p.end]
    return e


def _restore(m: Manifest, planned: Sequence[ClaimedBlock], files: dict[int, BlockInfo], got: dict,
             total: int) -> None:
    """Read the missed blocks of ``planned`` that ``got`` lacks into it, by :func:`_where`: each block's
    K/V per layer and, for a positional block, its :class:`SegmentView` (a snapshot's is None).

    Each run of consecutive missed positional blocks of a group gets one array per layer and part,
    sized for the whole run (a :class:`Segment`, as ``convert.extract`` makes), and every file of the
    run is read straight into its rows (``blockread``); the run's blocks are views of it, so
    ``convert.reconstruct`` hands a layer loaded whole over without a copy. A run that is the whole history
    of ``total`` tokens gets the spare slots of the agent's next turn too (:func:`_spare`).

    Raises:
        _Bad: a file failed its checks (nothing is added to ``got``).
        _Unreadable: a file could not be read now.
    """
    runs: list[list[ClaimedBlock]] = []
    prev = None  # the index of the last block to read
    for idx, p in enumerate(planned):
        if p.hit is not None or _where(p) in got:
            continue
        last = runs[-1][-1] if runs and prev == idx - 1 else None
        # a run goes on where the group's held buffer does (``blockclaim.block_spans``: position - shift)
        if (last is not None and not p.snapshot and not last.snapshot and last.group == p.group
                and last.end - last.shift == p.start - p.shift):
            runs[-1].append(p)
        else:
            runs.append([p])
        prev = idx
    if not runs:
        return
    fills = [_snapshot_fill(m, run[0], files) if run[0].snapshot else _run_fill(m, run, files, total) for run in runs]
    blockread.announce_ahead([files[k] for fill in fills for k in fill.rows])  # the disk starts while arrays are made
    made = iter(blockread.zeros([(s.shape, MX_DTYPES[s.dtype]) for fill in fills for s in fill.slots]))
    for fill in fills:
        fill.arrays = {s.name: next(made) for s in fill.slots}
    try:
        blockread.read_all([job for fill in fills for job in fill.jobs(files)])
    except CacheCorruptError as exc:
        bad = next((i for i in files.values() if i.path == exc.path), None)
        if bad is None:
            raise
        raise _Bad(bad, exc.reason) from None
    except OSError as exc:  # gone or unreadable now (permissions, too many open files): no verdict on it
        raise _Unreadable(str(exc)) from None
    made = []
    for fill in fills:
        for p, data, view in fill.blocks(fill):
            got[_where(p)] = (data, view)
            made.extend(x for kv in data.values() for side in kv for x in (side if isinstance(side, tuple) else (side,)))
    mx.eval(made, [list(fill.arrays.values()) for fill in fills])  # on this thread: mlx 0.32 evaluates an array only there


class _Fill:
    """Arrays for some missed blocks, one per tensor of ``slots`` (``blockformat``'s), and the rows of the
    files that fill them: ``rows`` maps a file's key to ``(lo, hi, at)`` triples (``blockread.Into``), or
    to None for a file whose tensors fill their arrays whole. ``blocks(fill)`` gives, once ``arrays`` are
    made, each block's K/V per layer and its segment view (None: a snapshot)."""

    def __init__(self, slots, rows: dict[int, list[tuple[int, int, int]] | None],
                 blocks: Callable[["_Fill"], list[tuple[ClaimedBlock, dict[int, LayerKV], SegmentView | None]]]):
        self.slots, self.rows, self.blocks = list(slots), rows, blocks
        self.arrays: dict[str, mx.array] = {}

    def jobs(self, files: dict[int, BlockInfo]) -> list[blockread.Into]:
        dests = {name: blockread.writable(a) for name, a in self.arrays.items()}
        return [blockread.Into(files[k], dests, None if r is None else tuple(sorted(r))) for k, r in self.rows.items()]

    def kv(self, i: int) -> LayerKV:
        """Layer ``i``'s (keys, values): an array per side, or a quantized side's (packed, scales, biases)."""
        a = self.arrays
        if f"layer.{i}.keys" in a:
            return a[f"layer.{i}.keys"], a[f"layer.{i}.values"]
        return tuple(tuple(a[f"layer.{i}.{side}.{q}"] for q in QPARTS) for side in ("keys", "values"))


def _run_fill(m: Manifest, run: list[ClaimedBlock], files: dict[int, BlockInfo], total: int) -> _Fill:
    """A run of missed positional blocks: one array per layer and part over the run's held-buffer
    rows ``[first.start - first.shift, last.end - last.shift)`` (and :func:`_spare` empty ones after
    them), each block's files read into its rows."""
    first, last = run[0], run[-1]
    lo, hi = first.start - first.shift, last.end - last.shift
    rows: dict[int, list[tuple[int, int, int]]] = {}
    for p in run:
        covered = 0
        for e in _overlapping(m, p.group, p.start, p.end):
            info = files[e.key]
            a, b = max(e.start, p.start), min(e.end, p.end)
            rows.setdefault(e.key, []).append((a - info.start, b - info.start, a - p.shift - lo))
            covered += b - a
        assert covered == p.end - p.start, (p.group, p.start, p.end, covered)

    spare = _spare(m, first, last, total)

    def blocks(fill: _Fill):
        for a in fill.arrays.values():  # read into rows below ``hi - lo``: the spare after costs nothing till written
            heap.unresident(a, hi - lo)
        seg = Segment({i: fill.kv(i) for i in first.layers}, hi - lo)
        return [(p, {}, SegmentView(seg, p.start - p.shift - lo)) for p in run]

    return _Fill(blockformat.block_slots(m.spec, first.group, hi - lo + spare), rows, blocks)


def _spare(m: Manifest, first: ClaimedBlock, last: ClaimedBlock, total: int) -> int:
    """Empty slots after a run that is a history's whole buffer from position 0, where its layers take
    room: the headroom a grown segment gets (``lending.restored_spare``), so the agent's turn after a
    restore is lent the segment as it was read, not a grown copy of it."""
    layer = m.spec.layers[first.layers[0]]
    whole = not first.start and not first.shift and not last.shift and last.end == total
    return lending.restored_spare(total) if whole and kinds.of(layer).takes_room(layer) else 0


def _snapshot_fill(m: Manifest, p: ClaimedBlock, files: dict[int, BlockInfo]) -> _Fill:
    """A snapshot block in the pool's format (``convert``): a recurrent layer's ``(arrays, ())``, a short
    window's ``(keys, values)`` of the tokens it holds after ``p.end``, in temporal order."""
    if p.group in m.snapshots:
        e = _snapshot_extent(m, p)
        info = files[e.key]
        assert info.snapshot and (info.start, info.end) == (p.start, p.end), (info, p)

        def snapshot(fill: _Fill):
            data = {}
            for i in p.layers:
                layer = m.spec.layers[i]
                if layer.kind == RECURRENT:
                    data[i] = (tuple(fill.arrays[f"layer.{i}.state.{j}"] for j in range(len(layer.arrays))), ())
                else:
                    data[i] = fill.kv(i)
            return [(p, data, None)]

        return _Fill(info.slots, {e.key: None}, snapshot)
    # a manifest written before snapshots: the window's positions, cut out of its positional files
    layer = m.spec.layers[p.layers[0]]
    rows: dict[int, list[tuple[int, int, int]]] = {}
    at = 0
    for a, b in layer.held_ranges(p.end):
        for e in _overlapping(m, p.group, a, b):
            info = files[e.key]
            lo, hi = max(e.start, a), min(e.end, b)
            rows.setdefault(e.key, []).append((lo - info.start, hi - info.start, at))
            at += hi - lo
    assert at == layer.tokens_held(p.end), (p.start, p.end)
    return _Fill(blockformat.block_slots(m.spec, p.group, at), rows, lambda fill: [(p, {i: fill.kv(i) for i in p.layers}, None)])
