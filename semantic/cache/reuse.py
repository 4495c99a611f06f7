"""Which cached prefix a new prompt can start from.

A turn arrives as the agent's whole token history. Its K/V at position
``i`` depend only on tokens ``[0, i]``, so any block whose tokens match the
history up to some position can serve every position before it, whoever
stored it and wherever its window was:

- **own**: the agent's cache from its previous turn, up to the first token
  where the histories differ (an edited or regenerated message);
- **pool**: keyed blocks of any agent under the same root: full blocks
  whose chained key and token ids match, and children of a matching prefix
  (a tail, or a full block of another branch) that match the history's first
  ``k`` tokens after it, cut there (``pool.children``). So an agent's earlier
  branch, released when a regenerate or an edit replaced it, stays
  reachable until its blocks are recycled.

The start is the longest prefix ``t`` for which every layer group finds
what it holds after ``t`` tokens: all of ``[0, t)`` for global layers, the
window ``[t - W, t)`` for sliding ones. At least one token is always left
to prefill::

    cached (own)     [ sys | q1 a1 | q2 a2 ........... ]            sliding: holds [T-W, T)
    new history      [ sys | q1 a1 | q2' (edited) ......... q3 ]
                                   ^ first difference d
    global           [0, d)        own blocks, or pooled ones
    sliding          [d - W, d)    own blocks (a window edge shared from the pool
                                   reaches back) and pooled full blocks

Only the last block of a group may be cut short (a block that matches the
history only up to ``t``); every other block serves all its positions.
Nothing at or after the first difference is reused by either source: a
pooled block's key chains every token before it, and every hit is confirmed
by its token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from semantic.cache import blockclaim, convert
from semantic.cache.blocks import AgentBlocks, KVBlock
from semantic.cache.pool import BlockPool

OWN, OWN_CUT, POOL, NONE = "own", "own-cut", "pool", "none"


@dataclass(slots=True)
class Reuse:
    """What a request starts from: ``cached`` tokens from ``source``.

    ``blocks`` are the blocks to rebuild the first ``cached`` tokens from
    (the agent's own, or new pool references the caller must release when
    ``owned`` is true).
    """

    source: str
    cached: int
    blocks: AgentBlocks | None = None
    owned: bool = False

    def __post_init__(self):
        assert self.source in (OWN, OWN_CUT, POOL, NONE), self.source
        assert (self.blocks is None) == (self.cached == 0), (self.source, self.cached)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass(frozen=True, slots=True)
class _Candidate:
    """A block whose positions ``[block.start, valid)`` hold this history's K/V."""

    block: KVBlock
    valid: int
    own: bool

    @property
    def complete(self) -> bool:
        return self.valid == self.block.end


def _candidates(pool: BlockPool, ids: tuple[int, ...], own: AgentBlocks | None, same: int,
                salt_root: int | None) -> dict[str, list[_Candidate]]:
    """Per group, every block that serves a prefix of ``ids``: ``own``'s up to
    ``same`` (its common prefix with ``ids``), and the pool's (see the module doc)."""
    bt = pool.block_tokens
    out: dict[str, list[_Candidate]] = {g: [] for g in pool.spec.groups()}
    whole = pool.spec.snapshot_groups(pool.block_tokens)  # a snapshot serves only where it was taken: all its tokens must match
    seen: set[int] = set()
    if own is not None and same:
        for g, blocks in own.groups.items():
            for blk in blocks:
                if blk.start < same and (g not in whole or blk.end <= same):
                    out[g].append(_Candidate(blk, min(blk.end, same), True))
                    seen.add(id(blk))
    chain = blockclaim.chain_keys(ids, bt, salt_root)
    for g in out:
        for k in range(len(ids) // bt + 1):
            if k * bt >= len(ids) - 1:
                break  # the last token is always prefilled
            for blk in pool.children(chain[k - 1] if k else salt_root, g):
                if id(blk) in seen or blk.start != k * bt:
                    continue
                m = common_prefix(blk.token_ids, ids[k * bt : k * bt + blk.n_tokens])
                if m and (g not in whole or m == blk.n_tokens):
                    out[g].append(_Candidate(blk, k * bt + m, False))
                    seen.add(id(blk))
    return out


def _cover(cands: list[_Candidate], ranges: list[tuple[int, int]], t: int) -> list[_Candidate] | None:
    """Blocks that hold ``ranges`` (what a group needs after ``t`` tokens), in the order
    ``convert.reconstruct`` reads them, or None. Only the last may be cut short."""
    chosen: list[_Candidate] = []
    for a, b in ranges:
        p = a
        while p < b:
            last = [c for c in cands if c.block.start <= p < c.valid and c.valid >= b and (c.complete or b == t)]
            if last:
                chosen.append(max(last, key=lambda c: (c.own, c.complete)))
                break
            step = [c for c in cands if c.complete and c.block.start <= p < c.valid]
            if not step:
                return None
            best = max(step, key=lambda c: (c.valid, c.own))
            chosen.append(best)
            p = best.valid
    unique: list[_Candidate] = []
    for c in chosen:
        if all(c.block is not u.block for u in unique):
            unique.append(c)
    return unique


def _plan(pool: BlockPool, cands: dict[str, list[_Candidate]], t: int) -> dict[str, list[_Candidate]] | None:
    """Every group's cover for a start at ``t``, or None when some group has none."""
    out, spec = {}, pool.spec
    whole = spec.snapshot_groups(pool.block_tokens)
    for g, layers in spec.groups().items():
        if g in whole:  # the snapshot taken after exactly t tokens
            snap = [c for c in cands[g] if c.complete and c.valid == t]
            if not snap:
                return None
            out[g] = [max(snap, key=lambda c: c.own)]
            continue
        cover = _cover(cands[g], spec.layers[layers[0]].held_ranges(t), t)
        if cover is None:
            return None
        out[g] = cover
    return out


def choose_start(
    pool: BlockPool, ids: tuple[int, ...], own: AgentBlocks | None, release=None, salt_root: int | None = None,
    *, share: bool = True, count: bool = True,
) -> Reuse:
    """The longest reusable prefix of ``ids`` (see the module doc).

    Takes pool references only for a ``POOL`` result (``owned``); nothing
    else changes. Pooled blocks are looked up under ``salt_root`` (a tenant's
    salt), and an own cache keyed under another root is not used; with
    ``share`` False the pool is not looked at (only ``own`` serves); with
    ``count`` False the pool's hit counts are left alone (a prediction). The
    caller holds the pool's lock, if threads share it.
    """
    limit = len(ids) - 1  # the last token must be prefilled to produce logits
    if own is not None and (own.released or own.salt_root != salt_root):
        own = None
    same = min(common_prefix(own.token_ids, ids), limit) if own is not None else 0
    own_len = same if same and convert.covers(own, same) else 0
    if own_len and own_len == limit:
        return Reuse(OWN if own_len == own.total_tokens else OWN_CUT, own_len, own)
    if not share:
        if same and not own_len:  # a snapshot group's state stands only at its snapshots: the latest of own's before
            own_len = max((e for e in {b.end for bl in own.groups.values() for b in bl} if e < same
                           and convert.covers(own, e)), default=0)
        return Reuse(OWN if own_len == own.total_tokens else OWN_CUT, own_len, own) if own_len else Reuse(NONE, 0)
    cands = _candidates(pool, ids, own, same, salt_root)
    ends = {c.valid for cs in cands.values() for c in cs if own_len < c.valid}
    for t in sorted({min(e, limit) for e in ends}, reverse=True):
        plan = _plan(pool, cands, t)
        if plan is None:
            continue
        used = [c for cover in plan.values() for c in cover]
        if all(c.own for c in used) and convert.covers(own, t):
            return Reuse(OWN if t == own.total_tokens else OWN_CUT, t, own)
        groups = {g: [pool.acquire(c.block) for c in cover] for g, cover in plan.items()}
        if count:
            pool.record_lookups(hits=sum(not c.own for c in used), misses=0)
        # blocks may reach past t (a pooled block cut short): fit only to rebuild the first t tokens
        blocks = AgentBlocks(pool.spec, ids[:t], groups, pool.block_tokens, _release=release or pool.release, salt_root=salt_root)
        return Reuse(POOL, t, blocks, owned=True)
    if own_len:
        return Reuse(OWN if own_len == own.total_tokens else OWN_CUT, own_len, own)
    return Reuse(NONE, 0)
