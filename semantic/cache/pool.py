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
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from semantic import defaults
from semantic.cache.blocks import KVBlock, LayerKV
from semantic.errors import PoolExhaustedError
from semantic.cache.spec import ModelCacheSpec


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Block counts; ``cached`` free blocks still hold data a hit can reuse."""

    total: int
    used: int
    free: int
    cached: int
    shared: int
    hits: int
    misses: int
    used_bytes: int


def chain_hash(parent: int | None, token_ids: Sequence[int], group: str = "") -> int:
    """64-bit key of a full block: parent key, the group, and the token ids."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent if parent is not None else -1).to_bytes(8, "little", signed=True))
    h.update(group.encode())
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


class BlockPool:
    """``total_blocks`` blocks of ``block_tokens`` tokens for one cache spec."""

    def __init__(self, spec: ModelCacheSpec, total_blocks: int, block_tokens: int = defaults.BLOCK_TOKENS):
        if total_blocks <= 0:
            raise ValueError(f"total_blocks must be positive, got {total_blocks}")
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.spec = spec
        self.total_blocks = total_blocks
        self.block_tokens = block_tokens
        self._blocks: list[KVBlock | None] = [None] * total_blocks
        self._refs = [0] * total_blocks
        self._free: deque[int] = deque(range(total_blocks))
        self._by_hash: dict[int, int] = {}
        self._children: dict[tuple[int | None, str], set[int]] = {}  # (parent key, group) -> chained block ids
        self.hits = 0
        self.misses = 0

    @property
    def free_count(self) -> int:
        return len(self._free)

    def require_free(self, n: int) -> None:
        """Raise :class:`PoolExhaustedError` unless ``n`` blocks can be allocated."""
        if n > len(self._free):
            raise PoolExhaustedError(
                f"need {n} free blocks of {self.block_tokens} tokens but only {len(self._free)} "
                f"of {self.total_blocks} are free ({self.total_blocks - len(self._free)} in use); "
                f"release AgentBlocks you no longer need or raise total_blocks"
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
            self._free.remove(block.block_id)
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
        self.require_free(1)
        bid = self._free.popleft()
        old = self._blocks[bid]
        if old is not None and old.token_hash is not None:
            if self._by_hash.get(old.token_hash) == bid:
                del self._by_hash[old.token_hash]
            siblings = self._children.get((old.parent, old.group))
            if siblings is not None:
                siblings.discard(bid)
                if not siblings:
                    del self._children[(old.parent, old.group)]
        block = KVBlock(bid, group, start, len(token_ids), tuple(map(int, token_ids)), layer_data, key, parent=parent)
        self._blocks[bid] = block
        self._refs[bid] = 1
        if key is not None:
            self._by_hash[key] = bid
            self._children.setdefault((parent, group), set()).add(bid)
        return block

    def release(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference to each block, last block first."""
        for block in reversed(blocks):
            bid = block.block_id
            assert self._blocks[bid] is block, f"block {bid} was recycled while referenced"
            assert self._refs[bid] > 0, f"block {bid} released more often than acquired"
            self._refs[bid] -= 1
            if self._refs[bid] == 0:
                self._free.append(bid)
                if block.token_hash is None:
                    self._blocks[bid] = None  # private data can never be hit: free it now

    def refcount(self, block: KVBlock) -> int:
        return self._refs[block.block_id] if self._blocks[block.block_id] is block else 0

    def stats(self) -> PoolStats:
        live = [b for b, r in zip(self._blocks, self._refs) if b is not None and r > 0]
        return PoolStats(
            total=self.total_blocks,
            used=self.total_blocks - len(self._free),
            free=len(self._free),
            cached=sum(1 for bid in self._free if self._blocks[bid] is not None),
            shared=sum(1 for r in self._refs if r > 1),
            hits=self.hits,
            misses=self.misses,
            used_bytes=sum(b.nbytes for b in live),
        )
