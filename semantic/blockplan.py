"""Which pooled blocks a history needs, and taking them all or none.

Every way into the pool cuts a history the same way and keys its full blocks
the same way, so caches that arrive by different roads (a live mlx-lm cache,
a file) share their common prefix::

    tokens     0 ...... 255 | 256 ..... 511 | 512 .. 600
    chain      c0            c1              (partial: no key)
    key        hash(c0, group) per group, so one chain serves every group

:func:`plan_blocks` looks every full block up without taking anything;
:func:`commit` checks the pool can hold the misses, then acquires the hits
and allocates the misses with data from a callback. A caller may read data
between the two (``cachefile.load`` reads only the blocks that missed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from semantic.blocks import AgentBlocks, KVBlock, LayerKV, SegmentView
from semantic.pool import BlockPool, chain_hash
from semantic.spec import LayerSpec, ModelCacheSpec


@dataclass(frozen=True, slots=True)
class PlannedBlock:
    """Tokens ``[start, end)`` of one layer group.

    Position ``p`` sits at index ``p - shift`` of a layer's held (unrolled)
    buffer. ``key`` is set for full blocks; ``hit`` is the pooled block with
    that key and the same token ids, if any.
    """

    group: str
    layers: tuple[int, ...]
    start: int
    end: int
    shift: int
    key: int | None
    hit: KVBlock | None


@dataclass(frozen=True, slots=True)
class BlockPlan:
    """The blocks of one history, and how many free blocks taking them costs."""

    blocks: tuple[PlannedBlock, ...]
    need: int


def block_spans(layer: LayerSpec, total: int, block_tokens: int) -> list[tuple[int, int, int]]:
    """Held positions of a layer cut at block boundaries: ``(start, end, shift)``."""
    out, buffered = [], 0
    for a, b in layer.held_ranges(total):
        shift = a - buffered
        buffered += b - a
        while a < b:
            e = min(b, (a // block_tokens + 1) * block_tokens)
            out.append((a, e, shift))
            a = e
    return out


def chain_keys(token_ids: Sequence[int], block_tokens: int, root: int | None = None) -> list[int]:
    """One chained key per full block of ``token_ids`` (group-independent).

    ``root`` is the parent of the first block: a tenant's salt (see
    :func:`salt_root`), so the same tokens under two roots never share a key.
    """
    chain: list[int] = []
    for b in range(len(token_ids) // block_tokens):
        chain.append(chain_hash(chain[-1] if chain else root, token_ids[b * block_tokens : (b + 1) * block_tokens]))
    return chain


def salt_root(salt: str | bytes | None) -> int | None:
    """The chain root for ``salt`` (None: unsalted, the root every caller without a salt shares)."""
    if salt is None or salt == "" or salt == b"":
        return None
    return chain_hash(None, (), "salt:" + (salt.hex() if isinstance(salt, bytes) else salt))


def plan_blocks(
    pool: BlockPool, spec: ModelCacheSpec, token_ids: Sequence[int], chain: Sequence[int] | None = None,
    root: int | None = None,
) -> BlockPlan:
    """Look up every full block of ``token_ids`` in ``pool``; change nothing.

    ``chain`` is ``chain_keys(token_ids, pool.block_tokens, root)``, when the
    caller plans the same tokens more than once.
    """
    bt = pool.block_tokens
    tokens = token_ids if type(token_ids) is tuple else tuple(map(int, token_ids))
    chain = chain_keys(tokens, bt, root) if chain is None else chain
    out, need = [], 0
    for group, layers in spec.groups().items():
        for a, b, shift in block_spans(spec.layers[layers[0]], len(tokens), bt):
            key = hit = None
            if b - a == bt:
                key = chain_hash(chain[a // bt], (), group)
                hit = pool.lookup(key, tokens[a:b], count=False)
            # a cached hit sits in the free queue: acquiring it takes a free slot
            need += hit is None or pool.is_free(hit)
            out.append(PlannedBlock(group, layers, a, b, shift, key, hit))
    return BlockPlan(tuple(out), need)


def miss_runs(planned: Sequence[PlannedBlock]) -> list[list[int]]:
    """Indices of the missed blocks, in runs of consecutive blocks of one group
    (each run becomes one segment)."""
    runs: list[list[int]] = []
    for idx, p in enumerate(planned):
        if p.hit is not None:
            continue
        if runs and runs[-1][-1] == idx - 1 and planned[idx - 1].group == p.group:
            runs[-1].append(idx)
        else:
            runs.append([idx])
    return runs


def commit(
    pool: BlockPool,
    spec: ModelCacheSpec,
    token_ids: Sequence[int],
    planned: BlockPlan,
    data: Callable[[PlannedBlock], tuple[dict[int, LayerKV], SegmentView | None]],
    release: Callable[[list[KVBlock]], None] | None = None,
    root: int | None = None,
) -> AgentBlocks:
    """Take ``planned`` from ``pool`` as one agent's blocks.

    ``data(p)`` gives each missed block's K/V per layer and, when those are
    views into a segment, the block's :class:`blocks.SegmentView`, else None. It is called for every miss before anything is taken, so
    :class:`PoolExhaustedError` (the pool cannot hold the misses) or an error
    from ``data`` leaves the pool untouched. The plan must be fresh: nothing may have used the pool since
    :func:`plan_blocks` made it. ``release`` (default ``pool.release``) is what the
    returned AgentBlocks calls to give its blocks back; ``root`` is the chain root
    ``planned`` was keyed with.
    """
    tokens = token_ids if type(token_ids) is tuple else tuple(map(int, token_ids))
    pool.require_free(planned.need)
    # all data first, so a failing callback leaves the pool untouched
    fresh = {i: data(p) for i, p in enumerate(planned.blocks) if p.hit is None}
    keyed = [p for p in planned.blocks if p.key is not None]
    pool.record_lookups(hits=sum(p.hit is not None for p in keyed), misses=sum(p.hit is None for p in keyed))
    groups: dict[str, list[KVBlock]] = {g: [] for g in spec.groups()}
    for i, p in enumerate(planned.blocks):
        if p.hit is not None:
            groups[p.group].append(pool.acquire(p.hit))
        else:
            layer_data, view = fresh[i]
            block = pool.allocate(p.group, p.start, tokens[p.start : p.end], layer_data, p.key)
            block.segment_view = view
            groups[p.group].append(block)
    return AgentBlocks(spec, tokens, groups, pool.block_tokens, _release=release or pool.release, root=root)


def longest_cached_prefix(
    pool: BlockPool, spec: ModelCacheSpec, token_ids: Sequence[int], root: int | None = None
) -> tuple[int, BlockPlan | None]:
    """The longest whole-block prefix of ``token_ids`` whose cache the pool holds entirely.

    Returns ``(T, plan)``: ``T`` is a multiple of the block size, shorter than
    ``token_ids`` (at least one token is left to prefill), and every block
    every layer needs for ``T`` tokens is a pooled hit. For sliding layers
    that means the blocks of the window ending at ``T``, so a prefix whose
    window was never stored is refused rather than approximated. ``(0,
    None)`` when nothing qualifies; nothing is taken from the pool.
    """
    bt = pool.block_tokens
    tokens = token_ids if type(token_ids) is tuple else tuple(map(int, token_ids))
    chain = chain_keys(tokens, bt, root)
    for k in range((len(tokens) - 1) // bt, 0, -1):
        planned = plan_blocks(pool, spec, tokens[: k * bt], chain[:k])
        if all(p.hit is not None for p in planned.blocks):
            return k * bt, planned
    return 0, None
