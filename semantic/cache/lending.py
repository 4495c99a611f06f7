"""Lending a turn the pool's own buffers, so its prefill and decode write where the pool keeps its cache.

A layer group whose blocks are one segment from position 0 to its filled end is
handed to the turn as the segment's arrays (:func:`lend`), one turn at a time
(``Segment.lent``), recorded in a :class:`Loan`; ``convert.extract`` then finds
the turn wrote past the segment's tokens and makes its new blocks positions in
the same buffer. A segment without the turn's room grows first, one layer at a
time (:func:`grow`), so the pool holds its cache once plus one layer::

    segment            [ blk 0 ][ blk 1 ][ blk 2 )·········       filled to n_tokens, spare after
    lent to a turn     the same arrays: the turn writes from n_tokens on, in place
    grown              [ blk 0 ][ blk 1 ][ blk 2 )·················  a layer at a time, headroom for next turns

MLX writes into a buffer in place only while nothing else views it: a save's
byte views are let go once written (``cachefile.PreparedSave.release``), and the
scheduler holds back a turn whose agent's save still reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from semantic import heap
from semantic.cache.blocks import Segment, SegmentView, segment_runs
from semantic.kinds.batchone import WIDEN

# a tail a turn's cut leaves at most this many tokens of (a completion's reply the next prompt leaves out, an
# end-of-turn marker a template renders otherwise) is let go once the agent's history has moved past it
# (``CacheManager.let_go_left``): a return to that branch resumes where the new history's tail parts from it
# and prefills those few tokens again, where keeping the copy held a block's memory, up to 5% of a 4K-token
# cache, after every append. A regenerate of a longer reply keeps its old tail, to branch back to
LEFT_OUT = 4
# a finished cache's buffer is pooled as it is (no copy) when its spare slots are at most 1/SPARE_SHARE of its
# tokens, else copied exactly: a short cache would keep mlx-lm's 256-slot growth step in the pool
SPARE_SHARE = 32


@dataclass(eq=False)
class Loan:
    """The segments whose own buffers a turn's caches are (``convert.reconstruct``): the turn writes past
    their tokens in place, and ``convert.extract`` makes its new blocks positions there. A segment is lent to
    one turn at a time; :meth:`give_back` ends the loan when the turn is done."""

    lent: list = field(default_factory=list)
    grown: int = 0  # segments grown for the turn (:func:`grow`)
    joined: int = 0  # histories of several segments joined into one for the turn (:func:`join`)
    # what a decode that outgrew the room let go, layer by layer (:func:`widen`)
    releasing: heap.Releasing = field(default_factory=heap.Releasing)
    # tails the turn's cut copied out that it leaves at most ``LEFT_OUT`` tokens of (:func:`cut`)
    left: list = field(default_factory=list)

    def give_back(self) -> None:
        for seg in self.lent:
            seg.lent = False
            for cache in seg.handed.values():  # its widen names the segment: kept, the two would hold each other
                setattr(cache, WIDEN, None)
        self.lent = []


def headroom(tokens: int) -> int:
    """Spare slots a segment grown for a turn gets beyond the turn's room, on mlx-lm's 256-slot grid: at least
    a step, about 1/SPARE_SHARE of its tokens, so that the agent's next turns find their room there too."""
    return -(-max(tokens // SPARE_SHARE, 1) // 256) * 256


def restored_spare(tokens: int) -> int:
    """Spare slots a history of ``tokens`` read from disk whole gets (``store.blockload``): the :func:`headroom`
    a segment grown for a turn gets, a turn's room of up to a step (the usual next turn: a tool's output, a
    user's message) and more at longer histories, so that turn need not grow it; none where that is over
    an eighth of the history (a short one grows in little time, and restored agents' spare slots would be
    most of their memory)."""
    spare = headroom(tokens)
    return spare if spare * 8 <= tokens else 0


def lend(pieces: list, total: int, room: int, loan: Loan, pool=None) -> Segment | None:
    """The segment to lend a layer group whose blocks are ``pieces`` (:func:`whole_segment`), cut at ``total``
    when it holds more (:func:`cut`, given the ``pool``), grown first when it lacks ``room`` spare, recorded in
    ``loan``; a history over several segments is joined into its first one first (:func:`join`); None when
    there is none or another turn has it."""
    seg = whole_segment(pieces, total)
    split = joinable(pieces, pool) if seg is None and pool is not None else None
    if split is not None:
        seg = join(pool, pieces, total, room, *split)
        loan.joined += 1
    if seg is None or seg.lent:
        return None
    if seg.n_tokens > total and (pool is None or not cut(pool, seg, total, pool.block_tokens, loan.left)):
        return None
    if seg.capacity - total < room:
        grow(seg, room + headroom(total))
        loan.grown += 1
    seg.lent = True
    loan.lent.append(seg)
    return seg


def whole_segment(pieces: list, total: int) -> Segment | None:
    """The segment whose index 0 is position 0 and whose first ``total`` tokens are exactly ``pieces`` (one run
    of views into it from its start), else None."""
    runs = segment_runs(pieces, next(iter(pieces[0][0].layers)))
    if len(runs) != 1 or not isinstance(runs[0].source, Segment):
        return None
    (run,) = runs
    ok = run.start == 0 and run.stop == total <= run.source.n_tokens and pieces[0][0].start == 0
    return run.source if ok else None


def lendable(pieces: list, total: int, pool) -> bool:
    """Whether :func:`lend` would lend these ``pieces`` now (to admission: a turn not lent holds a copy), its
    room aside: one segment from position 0, no other turn's, ending at ``total`` or cut there; or a history
    of several that :func:`join` makes one."""
    seg = whole_segment(pieces, total)
    if seg is None:
        return pool is not None and joinable(pieces, pool) is not None
    return not seg.lent and (seg.n_tokens <= total or (pool is not None and cuttable(pool, seg, total)))


def cuttable(pool, seg: Segment, total: int) -> bool:
    """Whether :func:`cut` may make ``seg`` end at ``total``: what it holds past it lies in one block slot, or no
    block holds those positions any more (a history whose blocks there were recycled). A full block past the
    cut that the pool still keeps, cached or live, is another history's to resume from: never cut into."""
    bt = pool.block_tokens
    return seg.n_tokens <= total - total % bt + bt or not pool.sitting_in(seg, total)


def joinable(pieces: list, pool) -> tuple[Segment, int] | None:
    """The first segment of a history held in several (``pieces``: the part from its first segment, then runs
    of others, or blocks of their own) and where the history leaves it, when :func:`join` may copy the rest
    into it: it holds positions 0 on at their index, no turn has it, and it may be cut there
    (:func:`cuttable`); else None. A history split by an eviction (its first blocks still pooled, the rest
    read back from disk) or by a turn that got a copy."""
    runs = segment_runs(pieces, next(iter(pieces[0][0].layers)))
    first = runs[0]
    if len(runs) < 2 or not isinstance(first.source, Segment) or first.start != 0 or pieces[0][0].start != 0:
        return None
    seg = first.source
    return (seg, first.stop) if not seg.lent and cuttable(pool, seg, first.stop) else None


def cut(pool, seg: Segment, total: int, block_tokens: int, left: list | None = None) -> bool:
    """Make ``seg`` end at ``total`` so that a turn may write there: a turn resuming a little before its
    cache's end (a completion whose reply the next prompt leaves out, a chat template that renders the reply's
    last token otherwise). Every block holding positions from ``total`` on (the tails in its last block slot)
    takes its own copy of them, or, referenced by nobody, leaves the pool, so no block reads what the turn
    writes. Those copies stay cached like any block, for a regenerate of the history before the turn or a
    return to that branch, until the pool needs their room; but a tail the turn leaves at most ``LEFT_OUT``
    tokens of goes to ``left``, let go once the turn's history replaced the old one
    (``CacheManager.let_go_left``). False, changing nothing, when those
    blocks reach past one block slot (a regenerate or an edit further back: full blocks other histories may
    share): that turn gets a copy."""
    if not cuttable(pool, seg, total):
        return False
    edge = total - total % block_tokens
    behind = pool.sitting_in(seg, total)
    assert all(b.segment_view.start >= edge for b in behind), (edge, behind)  # blocks start on block boundaries
    made = []
    for b in behind:
        if pool.refcount(b) == 0:
            pool.forget(b)
        else:
            past = b.segment_view.start + b.n_tokens - total  # the tokens of it the turn writes over
            b.layer_data = {i: (_owned(k), _owned(v)) for i, (k, v) in b.layer_data.items()}
            made.extend(b.own_data.values())
            if left is not None and past <= LEFT_OUT:
                left.append(b)
    mx.eval(made)
    seg.n_tokens = total
    return True


def join(pool, pieces: list, total: int, room: int, seg: Segment, at: int) -> Segment:
    """Copy the rest of a history held in several segments into its first one ``seg``, which it leaves at ``at``
    (:func:`joinable`), one layer at a
    time, with the turn's ``room`` and :func:`headroom` after it, and make the blocks wholly inside it positions
    there: the history is one segment again, so this turn and the next are lent it, where each would copy the
    whole cache. A block that reaches past ``total`` (a pooled block the history cuts short) keeps its place;
    a segment whose blocks all moved goes. The bytes copied are the history's own, so every block reads what
    it read before."""
    if seg.n_tokens > at:
        done = cut(pool, seg, at, pool.block_tokens)
        assert done, (seg.n_tokens, at)  # joinable found it cuttable
    rest = [(blk, s, e) for blk, s, e in pieces if blk.start + e > at]
    more = total - at + room + headroom(total)
    releasing = heap.Releasing()
    for i in list(seg.layer_data):
        k, v = seg.layer_data[i]
        parts_k, parts_v, where = [k[..., :at, :]], [v[..., :at, :]], at
        for blk, s, e in rest:
            s = max(s, where - blk.start)  # a piece may overlap the one before it (``convert._pieces``)
            if blk.start + e <= where:
                continue
            bk, bv = blk.kv(i)
            parts_k.append(bk[..., s:e, :])
            parts_v.append(bv[..., s:e, :])
            where = blk.start + e
        assert where == total, (where, total)
        b, h, _, _ = k.shape
        parts_k.append(mx.zeros((b, h, more - (total - at), k.shape[3]), dtype=k.dtype))
        parts_v.append(mx.zeros((b, h, more - (total - at), v.shape[3]), dtype=v.dtype))
        joined = (mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2))
        old = k.nbytes + v.nbytes
        del k, v, parts_k, parts_v
        mx.eval(joined)
        _unresident(joined, total)
        seg.replace(i, joined)
        releasing.let_go(old)
        del joined
    seg.n_tokens = total
    for blk, _s, _e in rest:
        if blk.start >= at and blk.end <= total:  # none of them was in ``seg``: it was cut at ``at``
            blk.own_data, blk.segment_view = {}, SegmentView(seg, blk.start)
    heap.give_back(0)
    return seg


def grow(seg: Segment, more: int) -> None:
    """Give ``seg`` ``more`` spare slots after its tokens, one layer at a time: each layer's new buffer is made
    and its old one let go before the next, so the pool holds its cache once plus one layer, never twice (a
    buffer something else still holds, a save being written, goes when that does)."""
    n, releasing = seg.n_tokens, heap.Releasing()
    for i in list(seg.layer_data):
        k, v = seg.layer_data[i]
        grown = (_widened(k, n, more), _widened(v, n, more))
        mx.eval(grown)
        _unresident(grown, n)
        seg.replace(i, grown)
        old = k.nbytes + v.nbytes
        del k, v, grown
        releasing.let_go(old)  # after the last holder of the old layer let go
    heap.give_back(0)  # the old buffers, from MLX's buffer cache and the heap: the process holds one copy


def widen(seg: Segment, layer: int, releasing: heap.Releasing, keep: int, slots: int) -> tuple:
    """Layer ``layer`` of lent ``seg`` with room for ``slots`` tokens in all, its first ``keep`` slots kept (the
    turn's tokens so far) and :func:`headroom` after: a lent turn's decode that outgrew its room. The
    segment's arrays are replaced, so the turn keeps writing where the pool keeps its cache; the caller lets
    go of the old ones first, and each layer's old buffer goes before the next layer's grows (a decode step
    widens every layer in turn), where mlx-lm's growth by 256 slots copied every layer beside the pool's."""
    k, v = seg.layer_data[layer]
    more = slots - keep + headroom(slots)
    grown = (_widened(k, keep, more), _widened(v, keep, more))
    old = k.nbytes + v.nbytes
    del k, v
    seg.replace(layer, grown)
    mx.eval(grown)
    _unresident(grown, keep)
    releasing.let_go(old)
    return grown


def _owned(x):
    """A copy of view ``x`` in a buffer of its own: its bytes move out of the segment it views. An exact
    product (times one keeps every finite value and its sign); ``out[...] = x`` hands back the view, and
    ``mx.array(x)`` does not copy under every MLX this runs on: a view keeps the segment's buffer shared."""
    return x * 1


def _unresident(kv: tuple, n: int) -> None:
    """The pages of a new layer's spare slots (from ``n`` on) back to the system until a turn writes them."""
    for x in kv:
        heap.unresident(x, n)


def _widened(x, n: int, more: int):
    """The first ``n`` token slots of ``x`` (batch, heads, slots, dim) and ``more`` empty ones after them."""
    b, h, _, d = x.shape
    return mx.concatenate([x[..., :n, :], mx.zeros((b, h, more, d), dtype=x.dtype)], axis=2)
