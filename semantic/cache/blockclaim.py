"""Which pooled blocks a history needs, and taking them all or none.

Every way into the pool cuts a history the same way and keys its blocks the
same way, so caches that arrive by different roads (a live mlx-lm cache,
a file) share their common prefix::

    tokens     0 ...... 255 | 256 ..... 511 | 512 .. 600
    chain      c0            c1              p2 = hash(c1, tokens 512..600)
    key        hash(c0, group), hash(c1, group), hash(p2, group): one chain serves every group

A full block and a tail (a partial block starting at a boundary) are keyed;
a block is indexed under its parent (``c1`` for the tail above), so a later
history can use a prefix of it (``pool.children``).

A sliding group's window edge starts mid-block. Its K/V at position ``i``
depend only on tokens ``[0, i]``, not on where the window is, so when the
pool holds the full block that covers the edge, the group references that
block instead of copying a private partial; reconstruction slices what it
needs::

    window 512 at T = 900      held [388 .................. 900)
    blocks            [256 ... 512)[512 .... 768)[768 .. 900)
                       ^ pooled full block, shared (positions 256..387 unused)
                      without it: [388 .. 512) private partial

:func:`claim_blocks` looks every block up without taking anything;
:func:`commit` checks the pool can hold the misses, then acquires the hits
and allocates the misses with data from a callback. A caller may read data
between the two (``cachefile.load`` reads only the blocks that missed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from semantic.cache.blocks import AgentBlocks, KVBlock, LayerKV, SegmentView
from semantic.cache.pool import BlockPool, chain_hash
from semantic.cache.spec import LayerSpec, ModelCacheSpec


@dataclass(frozen=True, slots=True)
class ClaimedBlock:
    """Tokens ``[start, end)`` of one layer group.

    Position ``p`` sits at index ``p - shift`` of a layer's stored (unrolled)
    buffer. ``key`` is set for full blocks and tails (``parent``: the key
    they are indexed under); ``hit`` is the pooled block with that key and
    the same token ids, if any.
    """

    group: str
    layers: tuple[int, ...]
    start: int
    end: int
    shift: int
    key: int | None
    hit: KVBlock | None
    parent: int | None = None
    snapshot: bool = False  # the group's whole cache at ``end`` (``snapshot_span``), not positions [start, end)


@dataclass(frozen=True, slots=True)
class BlockClaim:
    """The blocks of one history, and what taking them costs: ``need`` bytes of the pool's free
    blocks (``room``), ``misses`` blocks per group."""

    blocks: tuple[ClaimedBlock, ...]
    need: int
    misses: dict[str, int] = field(default_factory=dict)


def stored_ranges(layer: LayerSpec, total: int, stored_from: int | None = None) -> list[tuple[int, int]]:
    """The positions a buffer of ``layer`` holds: its held ranges, the last one
    starting at ``stored_from`` instead when given (a window edge stored with
    the rest of the full block that covers it, see ``cachefile``)."""
    ranges = layer.held_ranges(total)
    if stored_from is not None and ranges:
        a, b = ranges[-1]
        assert stored_from <= a and (len(ranges) == 1 or stored_from >= ranges[0][1]), (stored_from, ranges)
        ranges[-1] = (stored_from, b)
    return ranges


def block_spans(
    layer: LayerSpec, total: int, block_tokens: int, stored_from: int | None = None
) -> list[tuple[int, int, int]]:
    """Held positions of a layer cut at block boundaries: ``(start, end, shift)``, position
    ``p`` at index ``p - shift`` of a buffer holding ``stored_ranges(layer, total, stored_from)``."""
    out, buffered = [], 0
    held = layer.held_ranges(total)
    for (a, b), (sa, sb) in zip(held, stored_ranges(layer, total, stored_from)):
        shift = sa - buffered
        buffered += sb - sa
        while a < b:
            e = min(b, (a // block_tokens + 1) * block_tokens)
            out.append((a, e, shift))
            a = e
    return out


def window_edge(layer: LayerSpec, total: int, block_tokens: int) -> int | None:
    """Where the full block covering a sliding layer's window edge starts, when the
    window starts mid-block and that block lies inside the history (else None)."""
    ranges = layer.held_ranges(total)
    if not layer.windowed or total <= layer.window:
        return None
    a = ranges[-1][0]
    first = a - a % block_tokens
    after_keep = ranges[0][1] if len(ranges) > 1 else 0
    if a % block_tokens == 0 or first < after_keep or first + block_tokens > total:
        return None
    return first


def snapshot_span(total: int, block_tokens: int) -> tuple[int, int]:
    """The token span a snapshot after ``total`` tokens is keyed by: from the last block
    boundary before ``total`` to it, so it is keyed and indexed exactly like the tail (or
    the full block) ending there, and a history finds it as a child of its prefix::

        tokens      0 ...... 255 | 256 ..... 511 | 512 .. 600
        snapshot at 600                           [512 .. 600)   key of the tail
        snapshot at 512          [256 ..... 512)                 key of the full block
    """
    assert total > 0, total
    return (total - 1) // block_tokens * block_tokens, total


def snapshot_keys(tokens: Sequence[int], chain: Sequence[int], group: str, block_tokens: int,
                  salt_root: int | None = None) -> tuple[int | None, int]:
    """The parent and the pool key of ``group``'s snapshot after all of ``tokens`` (``chain``: their
    ``chain_keys``, or more): keyed as the tail or the full block ending there (:func:`snapshot_span`)."""
    a, b = snapshot_span(len(tokens), block_tokens)
    parent = chain[a // block_tokens - 1] if a else salt_root
    link = chain[a // block_tokens] if b - a == block_tokens else chain_hash(parent, tokens[a:b])
    return parent, chain_hash(link, (), group)


def chain_keys(token_ids: Sequence[int], block_tokens: int, salt_root: int | None = None) -> list[int]:
    """One chained key per full block of ``token_ids`` (group-independent).

    ``salt_root`` is the parent of the first block: a tenant's salt (see
    :func:`salt_root_of`), so the same tokens under two roots never share a key.
    """
    chain: list[int] = []
    for b in range(len(token_ids) // block_tokens):
        chain.append(chain_hash(chain[-1] if chain else salt_root, token_ids[b * block_tokens : (b + 1) * block_tokens]))
    return chain


def salt_root_of(salt: str | bytes | None) -> int | None:
    """The chain root for ``salt`` (None: unsalted, the root every caller without a salt shares)."""
    if salt is None or salt == "" or salt == b"":
        return None
    return chain_hash(None, (), "salt:" + (salt.hex() if isinstance(salt, bytes) else salt))


def claim_blocks(
    pool: BlockPool, spec: ModelCacheSpec, token_ids: Sequence[int], chain: Sequence[int] | None = None,
    salt_root: int | None = None, stored_from: dict[str, int] | None = None,
) -> BlockClaim:
    """Look up every keyed block of ``token_ids`` in ``pool``; change nothing.

    ``chain`` is ``chain_keys(token_ids, pool.block_tokens, salt_root)``, when the
    caller plans the same tokens more than once (``salt_root`` is still needed: the
    first block and a short tail are indexed under it). ``stored_from`` says, per
    sliding group, where the data buffer's window starts when it holds more
    than the window (a file that stored a shared edge block): a missed edge
    block is then taken whole from it, else it becomes a private partial.
    """
    bt = pool.block_tokens
    tokens = token_ids if type(token_ids) is tuple else tuple(map(int, token_ids))
    chain = chain_keys(tokens, bt, salt_root) if chain is None else chain
    assert not chain or chain[0] == chain_hash(salt_root, tokens[:bt]), "chain keyed under another root"
    total = len(tokens)
    stored_from = stored_from or {}
    out, misses = [], {}
    for group, layers in spec.groups().items():
        misses[group] = 0
        layer = spec.layers[layers[0]]
        if layer.snapshot_only(bt):
            if total:
                a, b = snapshot_span(total, bt)
                parent, key = snapshot_keys(tokens, chain, group, bt, salt_root)
                hit = pool.lookup(key, tokens[a:b], count=False)
                misses[group] += hit is None or pool.is_free(hit)
                out.append(ClaimedBlock(group, layers, a, b, 0, key, hit, parent, snapshot=True))
            continue
        spans = block_spans(layer, total, bt, stored_from.get(group))
        edge = window_edge(layer, total, bt)
        for a, b, shift in spans:
            key = hit = parent = None
            if a % bt == 0 and (b - a == bt or b == total):
                # a full block, or the tail: keyed, indexed under the prefix before it
                parent = chain[a // bt - 1] if a else salt_root
                link = chain[a // bt] if b - a == bt else chain_hash(parent, tokens[a:b])
                key = chain_hash(link, (), group)
                hit = pool.lookup(key, tokens[a:b], count=False)
            elif edge is not None and edge < a < edge + bt:
                # the window edge: the pooled full block covering it, or that block from the buffer
                e = edge + bt
                parent, key = chain[edge // bt - 1] if edge else salt_root, chain_hash(chain[edge // bt], (), group)
                hit = pool.lookup(key, tokens[edge:e], count=False)
                if hit is not None or _buffered(layer, total, stored_from.get(group), edge):
                    a, b = edge, e
                else:
                    key = parent = None
            # a cached hit is charged as free: acquiring it takes free bytes
            misses[group] += hit is None or pool.is_free(hit)
            out.append(ClaimedBlock(group, layers, a, b, shift, key, hit, parent))
    return BlockClaim(tuple(out), sum(pool.cost(g) * n for g, n in misses.items()), misses)


def claim_passed(
    pool: BlockPool, spec: ModelCacheSpec, token_ids: Sequence[int], ends: Sequence[int],
    buffers: dict[str, list[tuple[int, int]]], salt_root: int | None = None,
) -> BlockClaim:
    """The full blocks each positional group held after each of ``ends`` tokens that ``pool`` lacks,
    from buffers holding the positions ``buffers[group]`` back to back (a window: what a prefill
    chunk left, ``SnapshotPositions.passed``). Hits are left out: there is nothing to take."""
    bt = pool.block_tokens
    tokens = token_ids if type(token_ids) is tuple else tuple(map(int, token_ids))
    total = len(tokens)
    assert ends and all(e % bt == 0 and 0 < e <= total for e in ends), (ends, total)
    chain = chain_keys(tokens[: max(ends)], bt, salt_root)
    out, misses = [], {}
    for group, layers in spec.groups().items():
        layer = spec.layers[layers[0]]
        if layer.snapshot_only(bt):
            continue
        buffer = buffers[group]
        starts = {a for e in ends for lo, hi in layer.held_ranges(e) for a in range(-(-lo // bt) * bt, hi - bt + 1, bt)}
        misses[group] = 0
        for a in sorted(starts):
            key = chain_hash(chain[a // bt], (), group)
            if pool.lookup(key, tokens[a : a + bt], count=False) is not None:
                continue
            misses[group] += 1
            parent = chain[a // bt - 1] if a else salt_root
            out.append(ClaimedBlock(group, layers, a, a + bt, _shift(buffer, a, a + bt), key, None, parent))
    return BlockClaim(tuple(out), sum(pool.cost(g) * n for g, n in misses.items()), misses)


def _shift(buffer: list[tuple[int, int]], a: int, b: int) -> int:
    """The shift of positions ``[a, b)`` in a buffer holding the ranges ``buffer`` back to back."""
    buffered = 0
    for sa, sb in buffer:
        if sa <= a and b <= sb:
            return sa - buffered
        buffered += sb - sa
    raise AssertionError(f"the buffer {buffer} does not hold [{a}, {b})")


def _buffered(layer: LayerSpec, total: int, stored_from: int | None, position: int) -> bool:
    """Whether a buffer holding ``stored_ranges(layer, total, stored_from)`` holds ``position``."""
    return any(a <= position < b for a, b in stored_ranges(layer, total, stored_from))


def miss_runs(claim: Sequence[ClaimedBlock]) -> list[list[int]]:
    """Indices of the missed blocks, in runs of consecutive blocks of one group
    (each run becomes one segment)."""
    runs: list[list[int]] = []
    for idx, p in enumerate(claim):
        if p.hit is not None:
            continue
        if runs and runs[-1][-1] == idx - 1 and claim[idx - 1].group == p.group and not p.snapshot:
            runs[-1].append(idx)
        else:
            runs.append([idx])
    return runs


def commit(
    pool: BlockPool,
    spec: ModelCacheSpec,
    token_ids: Sequence[int],
    claim: BlockClaim,
    data: Callable[[ClaimedBlock], tuple[dict[int, LayerKV], SegmentView | None]],
    release: Callable[[list[KVBlock]], None] | None = None,
    salt_root: int | None = None,
    earlier: Sequence[KVBlock] = (),
) -> AgentBlocks:
    """Take ``claim`` from ``pool`` as one agent's blocks.

    ``earlier`` are snapshot blocks of the same history at earlier positions (live: their holder
    keeps a reference until this returns), which the agent carries too, before its own snapshot
    in their group: where a regenerate, or a client that re-renders the reply, resumes.

    ``data(p)`` gives each missed block's K/V per layer and, when those are
    views into a segment, the block's :class:`blocks.SegmentView`, else None. It is called for every miss before anything is taken, so
    :class:`PoolExhaustedError` (the pool cannot hold the misses) or an error
    from ``data`` leaves the pool untouched. The claim must be fresh: nothing may have used the pool since
    :func:`claim_blocks` made it. ``release`` (default ``pool.release``) is what the
    returned AgentBlocks calls to give its blocks back; ``salt_root`` is the chain root
    ``claim`` was keyed with.
    """
    tokens = token_ids if type(token_ids) is tuple else tuple(map(int, token_ids))
    pool.require_free(claim.need)
    # all data first, so a failing callback leaves the pool untouched
    fresh = {i: data(p) for i, p in enumerate(claim.blocks) if p.hit is None}
    keyed = [p for p in claim.blocks if p.key is not None]
    pool.record_lookups(hits=sum(p.hit is not None for p in keyed), misses=sum(p.hit is None for p in keyed))
    groups: dict[str, list[KVBlock]] = {g: [] for g in spec.groups()}
    ends = {p.group: p.end for p in claim.blocks if p.snapshot}
    for b in sorted(earlier, key=lambda b: b.end):
        assert b.group in ends and b.token_ids == tokens[b.start : b.end], (b.group, b.start, b.end)
        if b.end < ends[b.group] and all(o.end != b.end for o in groups[b.group]):
            groups[b.group].append(pool.acquire(b))
    # every hit held before any block is made: making one recycles cached blocks, never a claimed hit
    held = {i: pool.acquire(p.hit) for i, p in enumerate(claim.blocks) if p.hit is not None}
    for i, p in enumerate(claim.blocks):
        if i in held:
            groups[p.group].append(held[i])
        else:
            layer_data, view = fresh[i]
            block = pool.allocate(p.group, p.start, tokens[p.start : p.end], layer_data, p.key, parent=p.parent)
            block.segment_view = view
            groups[p.group].append(block)
    return AgentBlocks(spec, tokens, groups, pool.block_tokens, _release=release or pool.release, salt_root=salt_root)
