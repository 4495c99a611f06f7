"""A fixed budget of KV blocks with reference counts and hash-chained prefix sharing.

After nano-vllm's ``block_manager.py``: a full block's key hashes its
parent's hash plus its own token ids (and its layer group), so one key names
a whole prefix; a hit is confirmed by comparing token ids. Blocks are
reference-counted; a block whose count drops to zero goes to the back of the
free queue but keeps its data and key until it is handed out again, so a
released prefix can still be hit. Sequences release their blocks in reverse
order, so prefix blocks, the most shareable, are reused last.

Partial blocks that start at a block boundary (a history's tail) are keyed
and kept the same way, and every keyed block is also indexed by its parent
key, so a later history can use the longest token-id prefix of any child of
a prefix it shares (:meth:`BlockPool.children`): an agent's earlier branch,
released when a regenerate or an edit replaced it, stays reachable until
its blocks are recycled::

    chain      c0 ─► c1 ─┬─► [512 .. 606)   turn 2 as first answered (released, cached)
                         └─► [512 .. 607)   turn 2 edited (live)
    history    [ ........ c1 | 512 ...... 606 | 606 .. 618 )   hits 606 tokens
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from semantic import defaults
from semantic.cache import room
from semantic.cache.blocks import KVBlock, LayerKV
from semantic.errors import PoolExhaustedError
from semantic.cache.spec import ModelCacheSpec


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Block counts and bytes; ``cached`` free blocks still hold data a hit can reuse. ``total``
    is the capacity in blocks of the costliest group (``room.block_costs``)."""

    total: int
    used: int
    free: int
    cached: int
    shared: int
    hits: int
    misses: int
    used_bytes: int
    capacity_bytes: int = 0
    charged_bytes: int = 0   # what the live blocks are charged (each its group's full block)
    cached_bytes: int = 0    # what the cached blocks are charged


def chain_hash(parent: int | None, token_ids: Sequence[int], group: str = "") -> int:
    """64-bit key of a full block: parent key, the group, and the token ids."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent if parent is not None else -1).to_bytes(8, "little", signed=True))
    h.update(group.encode())
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


class BlockPool:
    """Blocks of ``block_tokens`` tokens for one cache spec, within ``capacity_bytes``.

    Each block is charged its group's full block (``semantic.cache.room``), live or cached, so the
    blocks held never pass the capacity: a new block recycles the oldest cached ones until it fits.
    ``total_blocks`` sizes the pool as that many blocks of the costliest group (the same for a
    model of one group).
    """

    def __init__(self, spec: ModelCacheSpec, total_blocks: int | None = None, block_tokens: int = defaults.BLOCK_TOKENS,
                 *, capacity_bytes: int | None = None):
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        if (total_blocks is None) == (capacity_bytes is None):
            raise ValueError("size the pool by total_blocks or by capacity_bytes, one of them")
        self.spec = spec
        self.block_tokens = block_tokens
        self.costs = room.block_costs(spec, block_tokens)
        self.block_bytes = max(self.costs.values())
        if capacity_bytes is None:
            if total_blocks <= 0:
                raise ValueError(f"total_blocks must be positive, got {total_blocks}")
            capacity_bytes = total_blocks * self.block_bytes
        if capacity_bytes < self.block_bytes:
            raise ValueError(f"a pool of {capacity_bytes} bytes holds no block of {self.block_bytes} bytes")
        self.capacity = capacity_bytes
        self._blocks: list[KVBlock | None] = []
        self._refs: list[int] = []
        self._empty: list[int] = []                 # slots holding nothing
        self._cached: dict[int, None] = {}          # free slots still holding keyed data, oldest first
        self.used_bytes = 0                         # charged to live blocks
        self.cached_bytes = 0                       # charged to cached blocks
        self._by_hash: dict[int, int] = {}
        self._children: dict[tuple[int | None, str], set[int]] = {}  # (parent key, group) -> chained block ids
        self.hits = 0
        self.misses = 0

    @property
    def total_blocks(self) -> int:
        """The capacity in blocks of the costliest group."""
        return self.capacity // self.block_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes new blocks may take now (cached blocks are recycled for them)."""
        return self.capacity - self.used_bytes

    @property
    def free_count(self) -> int:
        """Blocks of the costliest group that fit in the free bytes."""
        return self.free_bytes // self.block_bytes

    def cost(self, group: str) -> int:
        return self.costs[group]

    def require_free(self, nbytes: int) -> None:
        """Raise :class:`PoolExhaustedError` unless blocks costing ``nbytes`` can be allocated."""
        if nbytes > self.free_bytes:
            raise PoolExhaustedError(
                f"need {room.size(nbytes)} of free blocks ({-(-nbytes // self.block_bytes)} of {self.block_tokens} "
                f"tokens) but only {room.size(self.free_bytes)} of {room.size(self.capacity)} are free "
                f"({room.size(self.used_bytes)} in use); release AgentBlocks you no longer need or raise the pool"
            )

    def lookup(self, key: int, token_ids: Sequence[int], count: bool = True) -> KVBlock | None:
        """The registered block for ``key`` if its token ids match exactly."""
        bid = self._by_hash.get(key)
        block = self._blocks[bid] if bid is not None else None
        hit = block is not None and block.token_ids == tuple(token_ids)
        if count:
            self.hits += hit
            self.misses += not hit
        return block if hit else None

    def record_lookups(self, hits: int, misses: int) -> None:
        """Count lookups made with ``count=False`` once they took effect."""
        self.hits += hits
        self.misses += misses

    def children(self, parent: int | None, group: str) -> list[KVBlock]:
        """The keyed blocks of ``group`` that follow the prefix keyed ``parent`` (None: the
        unsalted root), live or cached; callers confirm token ids before using one."""
        return [self._blocks[bid] for bid in self._children.get((parent, group), ())]

    def is_free(self, block: KVBlock) -> bool:
        return self._refs[block.block_id] == 0

    def acquire(self, block: KVBlock) -> KVBlock:
        """Take one more reference to a live or cached block."""
        assert self._blocks[block.block_id] is block, "stale block"
        if self._refs[block.block_id] == 0:
            del self._cached[block.block_id]
            self.cached_bytes -= self.costs[block.group]
            self.used_bytes += self.costs[block.group]
        self._refs[block.block_id] += 1
        return block

    def allocate(
        self,
        group: str,
        start: int,
        token_ids: Sequence[int],
        layer_data: dict[int, LayerKV],
        key: int | None = None,
        *,
        parent: int | None = None,
    ) -> KVBlock:
        """A new block with one reference; ``key`` registers it for sharing, and
        indexes it under ``parent`` (the key of the prefix before it, or the root)."""
        cost = self.costs[group]
        self.require_free(cost)
        while self.used_bytes + self.cached_bytes + cost > self.capacity:
            self._recycle(next(iter(self._cached)))
        if self._empty:
            bid = self._empty.pop()
        else:
            bid = len(self._blocks)
            self._blocks.append(None)
            self._refs.append(0)
        block = KVBlock(bid, group, start, len(token_ids), tuple(map(int, token_ids)), layer_data, key, parent=parent)
        self._blocks[bid] = block
        self._refs[bid] = 1
        self.used_bytes += cost
        if key is not None:
            self._by_hash[key] = bid
            self._children.setdefault((parent, group), set()).add(bid)
        return block

    def _recycle(self, bid: int) -> None:
        """Drop a cached block's data and keys: its slot holds nothing again."""
        old = self._blocks[bid]
        del self._cached[bid]
        self.cached_bytes -= self.costs[old.group]
        if self._by_hash.get(old.token_hash) == bid:
            del self._by_hash[old.token_hash]
        siblings = self._children.get((old.parent, old.group))
        if siblings is not None:
            siblings.discard(bid)
            if not siblings:
                del self._children[(old.parent, old.group)]
        self._blocks[bid] = None
        self._empty.append(bid)
        old.layer_data = {}  # its bytes go now, though something (a segment's last cut) still names it

    def release(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference to each block, last block first."""
        for block in reversed(blocks):
            bid = block.block_id
            assert self._blocks[bid] is block, f"block {bid} was recycled while referenced"
            assert self._refs[bid] > 0, f"block {bid} released more often than acquired"
            self._refs[bid] -= 1
            if self._refs[bid] == 0:
                self.used_bytes -= self.costs[block.group]
                if block.token_hash is None:
                    self._blocks[bid] = None  # private data can never be hit: free it now
                    self._empty.append(bid)
                else:
                    self._cached[bid] = None
                    self.cached_bytes += self.costs[block.group]

    def sitting_in(self, segment, at: int) -> list[KVBlock]:
        """The blocks, live or cached, that hold positions of ``segment`` at index ``at`` or after: what a
        turn writing there would change under them (``lending.cut``). A scan of every slot: asked only when a
        turn resumes inside its own segment."""
        return [b for b in self._blocks if b is not None and b.segment_view is not None
                and b.segment_view.segment is segment and b.segment_view.start + b.n_tokens > at]

    def cached(self, block: KVBlock) -> bool:
        """Whether ``block`` is in this pool, keyed, and referenced by nobody (``forget`` may drop it)."""
        bid = block.block_id
        return bid < len(self._blocks) and self._blocks[bid] is block and self._refs[bid] == 0

    def forget(self, block: KVBlock) -> None:
        """Drop a cached block (no reference) now: its data and keys leave the pool."""
        assert self._blocks[block.block_id] is block and self._refs[block.block_id] == 0, block
        self._recycle(block.block_id)

    def refcount(self, block: KVBlock) -> int:
        """References to ``block`` (0: free, recycled, or of another pool)."""
        bid = block.block_id
        return self._refs[bid] if bid < len(self._blocks) and self._blocks[bid] is block else 0

    def stats(self) -> PoolStats:
        live = [b for b, r in zip(self._blocks, self._refs) if b is not None and r > 0]
        return PoolStats(
            total=self.total_blocks,
            used=len(live),
            free=self.free_count,
            cached=len(self._cached),
            shared=sum(1 for r in self._refs if r > 1),
            hits=self.hits,
            misses=self.misses,
            used_bytes=sum(b.nbytes for b in live),
            capacity_bytes=self.capacity,
            charged_bytes=self.used_bytes,
            cached_bytes=self.cached_bytes,
        )
