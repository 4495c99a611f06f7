"""Exact conversion between live mlx-lm caches and pooled blocks.

Extraction cuts each layer group's K/V at block boundaries (``blockclaim``,
shared with cache-file loading). Full blocks are looked up by their chained
key first: a hit takes a reference instead of a copy, so history an agent
already stored, or a prefix another agent stored, is never copied twice.
Each run of missed blocks is copied once per layer into a ``Segment`` in
which its blocks hold positions (or a finished turn's buffer becomes one).

Sliding layers are read through ``compat.temporal_rotating``: the ring is
unrolled, so a window of ``W`` tokens with ``keep`` pinned holds positions::

    [0, keep)  +  [T - (W - keep), T)          (all of [0, T) while T <= W)

and only those positions are stored (``LayerSpec.held_ranges``). Reconstruction
asks the blocks for the same positions and builds a ``RotatingKVCache`` in
that temporal order with its write index at the end, which mlx-lm continues
exactly like the ring. During a prefill, :func:`keep_passed` pools the blocks
a window held at the block boundaries a chunk passed, from the positions the
chunk's attention left before the window too (``snapshots``).

Reconstruction hands a layer over without a copy when its pieces are one
consecutive run of one segment, and otherwise concatenates them (one copy).
Asked for ``room`` (layers whose kind takes it), a turn with a ``lending.Loan`` gets
the segment's own buffers when its history is the whole segment (``lending``),
and writes there; any other gets one copy with the spare slots.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from semantic.cache import blockclaim, lending
from semantic.cache.lending import SPARE_SHARE, Loan
from semantic import compat, kinds
from semantic.kinds.batchone import WIDEN
from semantic.cache.blocks import AgentBlocks, Segment, SegmentView, segment_runs
from semantic.errors import CacheMismatchError
from semantic.cache.pool import BlockPool
from semantic.cache.spec import LayerSpec, ModelCacheSpec


def _slice(x, a: int, b: int, copy: bool, adopt: bool = True):
    if isinstance(x, tuple):
        return tuple(_slice(p, a, b, copy, adopt) for p in x)
    if a == 0 and b == x.shape[2]:
        if not copy:
            return x
        # adopted: a new array object over the same bytes, so MLX never writes into them in place while
        # the segment holds them (it copies), and may once the live cache that made them is gone
        return x[...] if adopt else mx.contiguous(x)
    view = x[..., a:b, :]
    return mx.contiguous(view) if copy else view


def _cat(parts: list):
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], tuple):
        return tuple(mx.concatenate(p, axis=2) for p in zip(*parts))
    return mx.concatenate(parts, axis=2)


def _spare(like, n: int):
    """``n`` empty token slots shaped and typed as ``like``'s."""
    b, h, _, d = like.shape
    return mx.zeros((b, h, n, d), dtype=like.dtype)


def _check_shape(i: int, layer: LayerSpec, x, n: int, what: str) -> None:
    """Shape and dtype of K or V holding ``n`` tokens against the spec (a positional kind)."""
    kinds.of(layer).check_kv(i, layer, x, n, what)


def _read(spec: ModelCacheSpec, caches: Sequence, total: int) -> list:
    """Each leaf cache's held data, read and checked by its kind (``semantic.kinds``): a
    :class:`compat.LayerState` in temporal order, or a recurrent layer's arrays."""
    caches, nesting = compat.flatten(caches)
    if nesting != spec.nesting:
        raise CacheMismatchError(f"caches nest as {nesting}; the spec says {spec.nesting}")
    if len(caches) != spec.n_layers:
        raise CacheMismatchError(f"{len(caches)} layer caches for a spec of {spec.n_layers} layers")
    return [kinds.of(layer).read(i, layer, c, total) for i, (c, layer) in enumerate(zip(caches, spec.layers))]


def extract(pool: BlockPool, caches: Sequence, token_ids: Sequence[int], release=None, salt_root: int | None = None,
            earlier: Sequence = (), *, loan: Loan | None = None) -> AgentBlocks:
    """Store live caches covering ``token_ids`` as pooled blocks.

    All-or-nothing: when the pool cannot hold the new blocks it raises
    :class:`PoolExhaustedError` before taking any block or copying anything.
    ``release`` is what the returned AgentBlocks calls to give its blocks
    back (default ``pool.release``; a locked one when threads share the pool).
    ``salt_root`` salts the block keys (``blockclaim.chain_keys``). ``earlier``: snapshot blocks of
    this history at earlier positions to carry as well (``blockclaim.commit``).

    ``loan``: the segments :func:`reconstruct` lent this turn (:class:`Loan`): where it wrote into one in
    place, its new blocks become positions there, with no copy (:func:`_store`).
    """
    spec = pool.spec
    tokens = tuple(map(int, token_ids))
    states = _read(spec, caches, len(tokens))
    flat, _ = compat.flatten(caches)
    loose = frozenset(i for i, (c, layer) in enumerate(zip(flat, spec.layers))
                      if kinds.of(layer).spare(c) * SPARE_SHARE > len(tokens))
    buffers = {i: b for i, (c, layer) in enumerate(zip(flat, spec.layers))
               if (b := kinds.of(layer).buffers(layer, c)) is not None}
    claim = blockclaim.claim_blocks(pool, spec, tokens, salt_root=salt_root)
    return _store(pool, spec, tokens, claim, states, release, salt_root, earlier, loose,
                  _Whole(buffers, loan))


def keep_passed(pool: BlockPool, caches: Sequence, token_ids: Sequence[int], ends: Sequence[int],
                salt_root: int | None = None) -> int:
    """Pool the full blocks every layer group held after each of ``ends`` tokens (block boundaries),
    from live caches after ``len(token_ids)`` tokens that still hold them: a window's cache right after
    a prefill chunk holds the ``window - 1`` positions before the chunk too (``SnapshotPositions.passed``).

    The new blocks are released at once: cached, hittable until the pool recycles them, so a later
    history starting at any of ``ends`` finds its window. Returns how many were new; raises
    :class:`PoolExhaustedError` before taking anything when the pool cannot hold them.
    """
    spec, bt = pool.spec, pool.block_tokens
    tokens = tuple(map(int, token_ids))
    total = len(tokens)
    caches, nesting = compat.flatten(caches)
    if nesting != spec.nesting or len(caches) != spec.n_layers:
        raise CacheMismatchError(f"{len(caches)} layer caches nesting as {nesting}; the spec says "
                                 f"{spec.n_layers} as {spec.nesting}")
    states, buffers = {}, {}
    for group, layers in spec.groups().items():
        layer = spec.layers[layers[0]]
        if layer.snapshot_only(bt):
            continue
        for i in layers:
            states[i] = kinds.of(spec.layers[i]).buffered(i, spec.layers[i], caches[i], total)
        keys = states[layers[0]].keys
        held = (keys[0] if isinstance(keys, tuple) else keys).shape[2]
        keep = [(0, layer.keep)] if layer.keep and held < total else []
        buffers[group] = keep + [(total - held + layer.keep if keep else total - held, total)]
    claim = blockclaim.claim_passed(pool, spec, tokens, ends, buffers, salt_root)
    if claim.blocks:
        _store(pool, spec, tokens, claim, states, None, salt_root).release()
    return len(claim.blocks)


@dataclass(frozen=True)
class _Whole:
    """A cache's whole buffers (``Kind.buffers``: layer -> (keys, values), spare slots included) and the
    segments it was lent: what lets a run of blocks sit in its buffer without a copy."""

    buffers: dict
    loan: Loan | None = None

    def holds(self, layers) -> bool:
        return all(i in self.buffers for i in layers)

    def wrote_into(self, seg: Segment, layers) -> bool:
        """Whether the turn wrote in place into lent ``seg``: its buffers are the segment's own arrays."""
        return self.loan is not None and any(s is seg for s in self.loan.lent) and all(
            self.buffers[i][0] is seg.layer_data[i][0] and self.buffers[i][1] is seg.layer_data[i][1] for i in layers)


def _before(claim: blockclaim.BlockClaim, idx: int) -> Segment | None:
    """The segment holding, at index = position, every hit block of the group before missed block ``idx``,
    and filled at least up to where ``idx`` starts (a tail block it held may be cut short there); else None."""
    group, seg = claim.blocks[idx].group, None
    for p in claim.blocks[:idx]:
        if p.group != group:
            continue
        where = p.hit.segment_view if p.hit is not None else None
        if where is None or p.shift or where.start != p.start or seg not in (None, where.segment):
            return None
        seg = where.segment
    return seg if seg is not None and seg.n_tokens >= claim.blocks[idx].start else None


def _rehome(claim: blockclaim.BlockClaim, whole: _Whole) -> None:
    """Hit blocks with data of their own (a tail a cut copied out: ``lending.cut``) at positions a segment
    lent to this turn now holds, the turn having written them there again, become positions in it and drop
    their copy: a regenerate keeps the agent's history one segment, lendable to its next turn, and the pool
    no second copy of its tail."""
    if whole.loan is None or not whole.loan.lent:
        return  # a turn that was lent nothing: every extraction of a copied or first turn
    for p in claim.blocks:
        blk = p.hit
        if blk is None or p.snapshot or p.shift or blk.segment_view is not None:
            continue
        seg = next((s for s in whole.loan.lent if set(p.layers) <= s.layer_data.keys()), None)
        if seg is None or p.start > seg.n_tokens or not whole.holds(p.layers) or not whole.wrote_into(seg, p.layers):
            continue
        seg.n_tokens = max(seg.n_tokens, p.end)  # the turn's buffer holds every claimed position
        blk.own_data, blk.segment_view = {}, SegmentView(seg, p.start)


def _store(pool: BlockPool, spec: ModelCacheSpec, tokens: tuple[int, ...], claim: blockclaim.BlockClaim, states,
           release, salt_root: int | None, earlier: Sequence = (), loose: frozenset = frozenset(),
           whole: _Whole = _Whole({})) -> AgentBlocks:
    """Take ``claim`` from ``pool``, copying each missed block from ``states[layer]`` (a buffer that
    holds position ``p`` at index ``p - shift``), as one AgentBlocks. Where ``whole`` has a layer group's
    buffers and a run of misses goes on to the end, the run may take no copy::

        the run is the whole buffer      a first turn: pooled as it is, unless ``loose`` (much spare)
        the run follows a lent segment   the turn wrote there in place: the segment now holds it
    """
    pool.require_free(claim.need)
    _rehome(claim, whole)

    # Each run of consecutive missed blocks is copied once per layer into a segment, or sits in a whole
    # buffer; its blocks hold positions in it, which reconstruction hands over whole.
    views: dict[int, tuple[dict, SegmentView | None]] = {}
    fresh = []
    for run in blockclaim.miss_runs(claim.blocks):
        first, last = claim.blocks[run[0]], claim.blocks[run[-1]]
        if first.snapshot:  # the group's whole cache at its end: a copy of every layer, no segment
            assert len(run) == 1 and first.end == len(tokens), (run, first)
            data = {i: kinds.of(spec.layers[i]).snapshot(states[i]) for i in first.layers}
            fresh.extend(data.values())
            views[run[0]] = (data, None)
            continue
        lo, hi = first.start - first.shift, last.end - last.shift  # held-buffer indices
        ends = hi == len(tokens) and not first.shift and whole.holds(first.layers)
        prior = _before(claim, run[0]) if ends and lo else None
        if prior is not None and whole.wrote_into(prior, first.layers):
            assert hi >= prior.n_tokens, (hi, prior.n_tokens)  # lent at its end: the turn only appended
            seg, lo = prior, 0
            seg.n_tokens = hi
        elif ends and not lo and not loose.intersection(first.layers):
            # the buffers themselves, spare slots included: the room of the agent's next turn
            seg = Segment({i: (whole.buffers[i][0][...], whole.buffers[i][1][...]) for i in first.layers}, hi)
        else:
            seg = Segment({}, hi - lo)
            for i in first.layers:
                st, adopt = states[i], i not in loose
                seg.layer_data[i] = (_slice(st.keys, lo, hi, True, adopt), _slice(st.values, lo, hi, True, adopt))
        fresh.append(list(seg.layer_data.values()))
        for idx in run:
            p = claim.blocks[idx]
            views[idx] = ({}, SegmentView(seg, p.start - p.shift - lo))
    mx.eval(fresh)
    index = {id(p): i for i, p in enumerate(claim.blocks)}
    return blockclaim.commit(pool, spec, tokens, claim, lambda p: views[index[id(p)]], release, salt_root, earlier)


def _one_segment(pieces: list, layer: int):
    """This layer's (keys, values) as one slice of one segment, when its pieces
    are one consecutive run of views into it (``blocks.segment_runs``), else None."""
    runs = segment_runs(pieces, layer)
    if len(runs) != 1 or not isinstance(runs[0].source, Segment):
        return None
    (run,) = runs
    k, v = run.source.layer_data[layer]
    return _slice(k, run.start, run.stop, False), _slice(v, run.start, run.stop, False)


def _pieces(blocks: AgentBlocks, layer: int, total: int) -> tuple[list, int, int]:
    """The (block, first, end) pieces holding what ``layer`` needs after ``total`` tokens,
    how many tokens it needs, and how many of them the blocks hold.

    Blocks are read in list order and each gives only the positions after
    those already taken, so a block may start before what is needed (a
    shared window-edge block) or overlap the one before it (a reuse plan
    that cuts a pooled block short: ``reuse``)::

        needed              [388 ........................ 597)
        blocks        [256 ...... 512)[512 ......... 606)
        pieces              [388  512)[512 ...... 597)
    """
    spec_layer = blocks.spec.layers[layer]
    if spec_layer.snapshot_only(blocks.block_tokens):
        # one block serves: the snapshot taken after exactly ``total`` tokens
        snap = [b for b in blocks.blocks_for_layer(layer) if b.end == total]
        n = spec_layer.tokens_held(total)  # a recurrent state stands at one position
        return ([(snap[-1], 0, snap[-1].n_tokens)], n, n) if snap and total else ([], n if total else 0, 0)
    ranges = spec_layer.held_ranges(total)
    pieces = []  # (block, first, end) in the block's own token indices
    for a, b in ranges:
        for blk in blocks.blocks_for_layer(layer):
            s, e = max(a, blk.start), min(b, blk.end)
            if s < e:
                pieces.append((blk, s - blk.start, e - blk.start))
                a = e
    return pieces, sum(b - a for a, b in ranges), sum(e - s for _, s, e in pieces)


def covers(blocks: AgentBlocks, upto: int) -> bool:
    """Whether ``blocks`` hold every position each layer needs after its first ``upto`` tokens.

    Always true for global layers (they hold every token). A sliding layer
    whose window has moved past ``upto`` no longer holds what the shorter
    history needs, so a cut there is refused, never approximated::

        held after T = 900 (window 512):           [388 ............ 900)
        needed for upto = 600:              [88 ......... 600)      not covered
        needed for upto = 900:                     [388 ............ 900)  covered
    """
    if blocks.released or not 0 <= upto <= blocks.total_tokens:
        return False
    for layers in blocks.spec.groups().values():
        _, held, got = _pieces(blocks, layers[0], upto)
        if got != held:
            return False
    return True


_LAYERS: dict[tuple[int, int], tuple] = {}


def _layers(spec: ModelCacheSpec, block_tokens: int) -> tuple:
    """Each layer's index, spec, group, kind and whether it resumes only from a snapshot: asked once per
    spec, not once per layer of every reconstruction (a small cache pays that per layer). Kept by the
    spec's identity: hashing a spec hashes every layer's, an eighth of a small resumed turn's rebuild."""
    hit = _LAYERS.get((id(spec), block_tokens))
    if hit is not None and hit[0] is spec:
        return hit[1]
    table = tuple((i, l, l.group, kinds.of(l), l.snapshot_only(block_tokens)) for i, l in enumerate(spec.layers))
    if len(_LAYERS) >= 64:
        _LAYERS.clear()
    _LAYERS[(id(spec), block_tokens)] = (spec, table)  # the spec held: its id is not reused meanwhile
    return table


def reconstruct(blocks: AgentBlocks, materialize: bool = True, upto: int | None = None, room: int = 0,
                loan: Loan | None = None, pool: BlockPool | None = None) -> list:
    """Real mlx-lm cache objects, one per layer, for the tokens of ``blocks``.

    With ``upto``, the caches cover only the first ``upto`` tokens (a
    conversation edited after that point); see :func:`covers` for when the
    blocks still hold that. With ``materialize`` the arrays are evaluated
    before returning, so the cost lands here and not in the first model call.
    With ``room``, layers whose kind takes it (``Kind.takes_room``) get that many spare slots after
    their tokens, made in the same copy that joins the pieces: mlx-lm's ``KVCache`` grows by copying
    the whole cache into a larger buffer at every prefill chunk that overflows it (2.8 s for one
    250-token chunk at 32.7K tokens of Qwen3-Coder's geometry here), and writes into spare slots in place.

    With a ``loan`` too (a turn that will hand it to :func:`extract` when it ends), a layer group whose
    blocks are one segment from position 0 to its end, which no other turn has, gets that segment's own
    buffers: no copy, the turn writes into the pool's buffer. A segment with less than ``room`` spare is
    grown first, one layer at a time, with headroom for the agent's next turns (``lending``). Given the
    ``pool`` too, a turn that resumes before the segment's end, within its last block slot, is lent it cut
    there (``lending.cut``: the blocks past the cut take their own copy or leave the pool).
    """
    if blocks.released:
        raise CacheMismatchError("these AgentBlocks were released; their blocks may be reused")
    spec, total = blocks.spec, blocks.total_tokens if upto is None else upto
    if not 0 <= total <= blocks.total_tokens:
        raise CacheMismatchError(f"upto={upto} is outside the {blocks.total_tokens} cached tokens")
    caches = []
    by_group: dict[str, tuple] = {}  # every layer of a group has the same blocks and ranges
    lent: dict[str, tuple[Segment, int] | None] = {}  # per group: the segment lent and its spare slots
    handed = 0  # caches that are the pool's own evaluated arrays: when all are, nothing to materialize
    for i, layer, group, kind, snapshot_only in _layers(spec, blocks.block_tokens):
        if group not in by_group:
            by_group[group] = _pieces(blocks, i, total)
        pieces, held, got = by_group[group]
        if got != held:
            raise CacheMismatchError(f"layer {i}: blocks hold {got} of the {held} tokens it needs")
        if not held:
            caches.append(layer.make_cache())
            continue
        if snapshot_only:
            caches.append(kind.build(i, layer, *pieces[0][0].kv(i), total, held))
            continue
        if group not in lent:  # asked once a group: every layer of it sits in the same segment
            seg = lending.lend(pieces, total, room, loan, pool) \
                if loan is not None and room and kind.takes_room(layer) else None
            lent[group] = (seg, seg.capacity - total) if seg is not None else None
        if lent[group] is not None:
            # the pool's own buffers: the turn writes past its tokens in place (``Segment``)
            seg, spare = lent[group]
            k, v = seg.layer_data[i]
            cache = seg.handed[i] = kind.build_with_room(i, layer, k, v, total, held, spare, seg.handed.get(i))
            # a decode that outgrows the room widens the segment's layer (batchone), not a copy beside it
            setattr(cache, WIDEN, functools.partial(lending.widen, seg, i, loan.releasing))
            caches.append(cache)
            handed += 1
            continue
        run = _one_segment(pieces, i)
        if run is not None and not (room and kind.takes_room(layer)):
            k, v = run
        elif run is not None:
            # the segment stays the pool's (another turn has it, or more blocks follow): a copy with room
            k, v = _cat([run[0], _spare(run[0], room)]), _cat([run[1], _spare(run[1], room)])
            caches.append(kind.build_with_room(i, layer, k, v, total, held, room))
            continue
        else:
            keys, values = [], []
            for blk, s, e in pieces:
                bk, bv = blk.kv(i)
                # per piece: concatenate would silently promote a wrong dtype
                _check_shape(i, layer, bk, blk.n_tokens, "keys")
                _check_shape(i, layer, bv, blk.n_tokens, "values")
                keys.append(_slice(bk, s, e, False))
                values.append(_slice(bv, s, e, False))
            if room and kind.takes_room(layer):
                k, v = _cat([*keys, _spare(keys[0], room)]), _cat([*values, _spare(values[0], room)])
                caches.append(kind.build_with_room(i, layer, k, v, total, held, room))
                continue
            k, v = _cat(keys), _cat(values)
        caches.append(kind.build(i, layer, k, v, total, held))
    if materialize and handed < len(caches):
        materialize_caches(caches)
    return compat.nest(caches, spec.nesting)


def held_outside(blocks: AgentBlocks, total: int, room: int, pool: BlockPool | None) -> int:
    """Bytes a turn rebuilt from the first ``total`` tokens of ``blocks`` with ``room`` spare slots holds
    beyond the pool's blocks, as :func:`reconstruct` with a loan would build it now: nothing for a group lent
    the pool's buffer (``lending.lendable``); a copy of its tokens and room for any other (another turn has
    the segment, the history is more than one, its kind writes no buffer in place); a snapshot group's state,
    which every step replaces. Admission charges it (``CacheManager.live_bytes``)."""
    out, seen = 0, {}
    for i, layer, group, kind, snapshot_only in _layers(blocks.spec, blocks.block_tokens):
        if snapshot_only:
            out += layer.bytes_held(total)
            continue
        in_place = room and kind.takes_room(layer)
        if group not in seen:
            pieces, held, _ = _pieces(blocks, i, total)
            seen[group] = bool(in_place and held and lending.lendable(pieces, total, pool))
        if not seen[group]:
            out += int(layer.token_bytes() * (layer.tokens_held(total) + (room if in_place else 0)))
    return out


def fresh(spec: ModelCacheSpec, room: int) -> list:
    """Empty mlx-lm caches for a turn with nothing cached, ``room`` slots made now where a layer's kind takes
    them: its prefill writes every chunk in place, where mlx-lm's ``KVCache`` grew by a copy of the whole
    cache at each chunk that overflowed it (two copies at once, at the end of a long prompt)."""
    caches = []
    for i, layer in enumerate(spec.layers):
        kind = kinds.of(layer)
        if not room or not kind.takes_room(layer):
            caches.append(layer.make_cache())
            continue
        k = mx.zeros((1, layer.n_kv_heads, room, layer.head_dim), dtype=layer.mx_dtype)
        v = mx.zeros((1, layer.n_kv_heads, room, layer.v_head_dim), dtype=layer.mx_dtype)
        caches.append(kind.build_with_room(i, layer, k, v, 0, 0, room))
    return compat.nest(caches, spec.nesting)


def materialize_caches(caches: Sequence) -> None:
    """Evaluate live caches' arrays now (what :func:`reconstruct` made lazily)."""
    flat, _ = compat.flatten(caches)
    mx.eval([compat.cache_arrays(c) for c in flat if not c.empty()])
