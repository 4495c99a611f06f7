"""The one door into the cache, for the scheduler and the executor: what a turn may take, where it starts,
what its prefill pools, what its end keeps.

The step loop computes in mlx-lm's cache objects; the pool keeps 256-token blocks. Between them a turn
asks these, and each is a method here (the pool's lock held for it, as its callers share the pool).
Before a turn is admitted, the scheduler asks::

    cached_now    how much of a prompt a turn started now would find cached (a prediction: nothing held)
    turn_need     the free pool bytes a turn will take at most (room.turn_need, and live_bytes)
    batch_row     a turn's row in a merged batch, for the planner to charge (room.row_bytes)

and once it runs, the executor::

    start         the longest reusable prefix of a prompt: the agent's own cache or pooled blocks (reuse)
    live_bytes    what a turn starting now would hold beyond the pool's blocks, for admission to charge
    rebuild       cache objects for those blocks (convert.reconstruct), over the pool's buffers when lent;
                  ``fresh`` ones with room for a turn that starts from nothing
    give_back     end a turn's loan of the pool's buffers; ``let_go_left`` then drops the old tails it left
    carry         the pooled snapshots a resumed turn's finished cache must hold on to (snapshots)
    keep_passed   a sliding window's blocks that a prefill chunk moved past, pooled before the ring drops them
    extract       a cache (finished, a checkpoint, in flight) stored as pooled blocks (convert.extract)

``pooled`` finds a prompt's cache made of pooled blocks alone, and ``release`` gives blocks back. Nothing
here decides when: the executor says when a turn starts, a chunk ends or a sequence finishes.
"""

from __future__ import annotations

import threading
from typing import Sequence

from semantic import kinds
from semantic.cache import blockclaim, convert, reuse, room, snapshots
from semantic.cache.lending import Loan
from semantic.cache.room import merged_bytes, size
from semantic.cache.blocks import AgentBlocks
from semantic.cache.pool import BlockPool
from semantic.cache.spec import ModelCacheSpec
from semantic.errors import PoolExhaustedError
from semantic.kinds.rows import APART_FROM_BYTES

# what the planner charges a merged batch, and how its errors write bytes: the same accounting as the pool's
__all__ = ["CacheManager", "Loan", "ROOM_STEP", "merged_bytes", "size", "turn_room"]


ROOM_STEP = 256  # mlx-lm's KVCache.step: the slots it grows by, which the room a resumed cache gets follows


def turn_room(new: int) -> int:
    """Slots for a turn's ``new`` prompt tokens and its first decode step, on mlx-lm's 256-slot grid."""
    return -(-(new + 1) // ROOM_STEP) * ROOM_STEP


class CacheManager:
    """A pool of one model's cache geometry, as its executor's turns use it (module doc)."""

    def __init__(self, pool: BlockPool, spec: ModelCacheSpec, lock: threading.RLock):
        self.pool, self.spec, self.lock = pool, spec, lock
        # where a prefill stops to take a snapshot, and which positions a finished cache carries
        self.positions = snapshots.SnapshotPositions(spec, pool.block_tokens)
        self.snapshot_groups = sorted(spec.snapshot_groups(pool.block_tokens))
        # resumed turns that wrote into the pool's own buffers, that got a copy, and segments grown for them
        self.lent_turns = self.copied_turns = self.grown_segments = self.joined_histories = 0
        self._left: list = []  # old tails the turns' cuts left: ``let_go_left``
        # per layer group, whether its turns may run in the pool's buffers: its kind's answer
        self.groups_in_place = {g: kinds.of(spec.layers[ls[0]]).takes_room(spec.layers[ls[0]])
                                for g, ls in spec.groups().items()}

    def release(self, blocks) -> None:
        with self.lock:
            self.pool.release(blocks)

    def start(self, ids: Sequence[int], own: AgentBlocks | None, salt_root: int | None, share: bool) -> reuse.Reuse:
        """The longest reusable prefix of ``ids`` (:func:`reuse.choose_start`); pool references only for a
        result the caller then owns (``owned``)."""
        with self.lock:
            return reuse.choose_start(self.pool, ids, own, self.release, salt_root, share=share)

    def cached_now(self, ids: Sequence[int], own: AgentBlocks | None, salt_root: int | None) -> int:
        """The tokens of ``ids`` a turn started now would find cached (its own cache, else pooled blocks), as
        :meth:`start` would answer: a prediction, which takes no reference and counts no lookup (the turn's
        start counts them once)."""
        with self.lock:
            start = reuse.choose_start(self.pool, ids, own, self.release, salt_root, count=False)
            if start.owned:
                start.blocks.release()
            return start.cached

    def turn_need(self, ids: Sequence[int], max_tokens: int, own: AgentBlocks | None, salt_root: int | None) -> int:
        """Free pool bytes a turn of ``ids`` generating up to ``max_tokens`` takes at most: the prompt's blocks
        the pool misses and those its tokens may fill (``room.turn_need``), and what it holds beyond the
        pool's blocks when it starts from ``own`` (:meth:`live_bytes`)."""
        with self.lock:
            claim = blockclaim.claim_blocks(self.pool, self.spec, ids, salt_root=salt_root)
        blocks = room.turn_need(self.spec, claim.misses, len(ids), max_tokens, self.pool.block_tokens)
        return blocks + self.live_bytes(ids, own, salt_root)

    def batch_row(self, prompt_tokens: int, apart: bool) -> int:
        """A turn's row in a merged batch, in bytes: its prompt and a step of decode (``room.row_bytes``). With
        ``apart`` (the executor keeps a batch's long rows apart, ``kinds.rows``) a row this long holds no merged
        copy of the layers that keep rows apart; its prompt alone is measured, as the step loop measures the
        buffers it joins with, never fewer."""
        n = prompt_tokens + ROOM_STEP
        if apart and room.row_bytes(self.spec, prompt_tokens) >= APART_FROM_BYTES:
            return room.row_bytes(self.spec, n, apart=True)
        return room.row_bytes(self.spec, n)

    def live_bytes(self, ids: Sequence[int], own: AgentBlocks | None, salt_root: int | None, share: bool = True) -> int:
        """Bytes a turn of ``ids`` started now (from ``own``, as :meth:`start` and :meth:`rebuild` would) holds
        beyond the pool's blocks: the copies its rebuild makes (``convert.held_outside``); 0 for a turn lent
        the pool's buffers or starting from nothing (its new blocks are the pool's, charged as misses)."""
        with self.lock:
            start = reuse.choose_start(self.pool, ids, own, self.release, salt_root, share=share, count=False)
            try:
                if not start.cached:
                    return 0
                return convert.held_outside(start.blocks, start.cached, turn_room(len(ids) - start.cached), self.pool)
            finally:
                if start.owned:
                    start.blocks.release()

    def rebuild(self, blocks: AgentBlocks, materialize: bool = True, upto: int | None = None, room: int = 0,
                loan: Loan | None = None) -> list:
        """Real mlx-lm cache objects, one per layer, for ``blocks`` (its first ``upto`` tokens), with ``room``
        spare slots where a layer's kind takes them; with a ``loan``, over the pool's own buffers where they
        have the room (``convert.reconstruct``): the caller hands the loan to :meth:`extract` and then
        :meth:`give_back`."""
        self.spec.require_same(blocks.spec, "these blocks")
        with self.lock:  # a segment is lent to one turn at a time
            caches = convert.reconstruct(blocks, materialize=False, upto=upto, room=room, loan=loan, pool=self.pool)
            if loan is not None:
                self.lent_turns += bool(loan.lent)
                self.copied_turns += not loan.lent
                self.grown_segments += loan.grown
                self.joined_histories += loan.joined
        if materialize:  # the copies, outside the lock
            convert.materialize_caches(caches)
        return caches

    @property
    def writes_in_place(self) -> bool:
        """Whether some layer group's turns may write into the pool's own buffers (``in_place``)."""
        return any(self.groups_in_place.values())

    def in_place(self) -> dict:
        """Which layer groups a turn runs in the pool's own buffers (the others copy their cache for a turn,
        as mlx-lm's classes grow it), and how often turns did."""
        return {"groups": dict(self.groups_in_place), "lent_turns": self.lent_turns,
                "copied_turns": self.copied_turns, "grown_segments": self.grown_segments,
                "joined_histories": self.joined_histories}

    def fresh(self, room: int) -> list:
        """Empty cache objects for a turn with nothing cached, with ``room`` slots where a layer's kind takes
        them (``convert.fresh``)."""
        return convert.fresh(self.spec, room)

    def give_back(self, loan: Loan) -> None:
        """End a turn's loan (``rebuild``): its segments may be lent again."""
        with self.lock:
            self._left.extend(loan.left)
            loan.left = []
            loan.give_back()

    def let_go_left(self) -> int:
        """Drop the old tails turns' cuts left a token or two of (``lending.LEFT_OUT``) that nothing references
        any more: the agents' histories moved past them (the caller released the ones they replaced). One
        still held (a save of the old history being written) waits for a later call. The blocks dropped."""
        with self.lock:
            held, dropped = [], 0
            for b in self._left:
                if self.pool.cached(b) and b.segment_view is None:  # not rehomed by a regenerate
                    self.pool.forget(b)
                    dropped += 1
                elif self.pool.refcount(b) > 0:
                    held.append(b)
            self._left = held
            return dropped

    def carry(self, ids: Sequence[int], at: Sequence[int], salt_root: int | None) -> AgentBlocks | None:
        """The pooled snapshots of ``ids`` at positions ``at`` that every snapshot group has (new references
        the caller owns), for a resumed turn's finished cache to carry; None when ``at`` is empty."""
        if not at:
            return None
        bt = self.pool.block_tokens
        chain = blockclaim.chain_keys(ids[: max(at)], bt, salt_root)
        with self.lock:
            found = {g: [] for g in self.snapshot_groups}
            for p in sorted(at):
                hits = [self.pool.lookup(blockclaim.snapshot_keys(ids[:p], chain, g, bt, salt_root)[1],
                                         ids[blockclaim.snapshot_span(p, bt)[0]: p], count=False)
                        for g in self.snapshot_groups]
                if all(h is not None for h in hits):
                    for g, h in zip(self.snapshot_groups, hits):
                        found[g].append(self.pool.acquire(h))
        return AgentBlocks(self.spec, ids[: max(at)], found, bt, _release=self.release, salt_root=salt_root)

    def keep_passed(self, caches: list, ids: Sequence[int], ends: Sequence[int], salt_root: int | None) -> None:
        """Pool the full blocks every layer group held after each of ``ends`` tokens (``convert.keep_passed``);
        a full pool keeps none of them."""
        with self.lock:
            convert.keep_passed(self.pool, caches, ids, ends, salt_root)

    def extract(self, caches: list, ids: Sequence[int], salt_root: int | None, earlier: Sequence = (), *,
                loan: Loan | None = None) -> AgentBlocks:
        """``caches`` (holding ``ids``) stored as pooled blocks the caller owns (``convert.extract``; a ``loan``
        says where their new tokens already are).

        Raises:
            PoolExhaustedError: the pool cannot hold the new blocks (nothing was taken).
        """
        with self.lock:
            return convert.extract(self.pool, caches, ids, self.release, salt_root, earlier, loan=loan)

    def pooled(self, ids: Sequence[int], salt_root: int | None = None) -> AgentBlocks | None:
        """The cache of ``ids`` made of pooled blocks alone (new references the caller owns), or None when
        the pool lacks one of them or cannot take back the cached ones."""
        with self.lock:
            claim = blockclaim.claim_blocks(self.pool, self.spec, ids, salt_root=salt_root)
            if not claim.blocks or any(p.hit is None for p in claim.blocks):
                return None
            try:
                return blockclaim.commit(self.pool, self.spec, ids, claim, lambda p: None, self.release, salt_root)
            except PoolExhaustedError:
                return None
