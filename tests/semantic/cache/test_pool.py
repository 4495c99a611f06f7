"""BlockPool: budget, reference counts, hash-chained sharing, reverse-order release."""

from __future__ import annotations

import mlx.core as mx
import pytest

from semantic import BlockPool, LayerSpec, ModelCacheSpec, PoolExhaustedError
from semantic.cache.pool import chain_hash

pytestmark = pytest.mark.compat

SPEC = ModelCacheSpec((LayerSpec("global", 1, 32, 32, "float32"),))


def _data(n=4):
    x = mx.zeros((1, 1, n, 32))
    return {0: (x, x)}


def _alloc(pool, tokens, key=None, start=0):
    return pool.allocate("global", start, tokens, _data(len(tokens)), key)


def test_exhaustion_names_the_numbers():
    pool = BlockPool(SPEC, total_blocks=2, block_tokens=4)
    _alloc(pool, [1, 2, 3, 4])
    _alloc(pool, [5, 6, 7, 8])
    with pytest.raises(PoolExhaustedError, match=r"\(1 of 4 tokens\) but only 0 B of .* are free"):
        _alloc(pool, [9])
    assert pool.stats().used == 2


def test_a_hash_hit_is_confirmed_by_token_ids():
    pool = BlockPool(SPEC, total_blocks=4, block_tokens=4)
    key = chain_hash(None, [1, 2, 3, 4])
    block = _alloc(pool, [1, 2, 3, 4], key)
    assert pool.lookup(key, [1, 2, 3, 4]) is block
    assert pool.lookup(key, [1, 2, 3, 5]) is None  # same key, other tokens: a collision, not a hit
    assert (pool.hits, pool.misses) == (1, 1)


def test_chain_hash_names_the_whole_prefix_and_the_group():
    a = chain_hash(None, [1, 2])
    assert chain_hash(a, [3, 4]) != chain_hash(chain_hash(None, [9, 9]), [3, 4])
    assert chain_hash(a, [], "global") != chain_hash(a, [], "sliding-w8-k0")


def test_shared_blocks_are_counted_once_and_freed_last_reference_last():
    pool = BlockPool(SPEC, total_blocks=4, block_tokens=4)
    block = _alloc(pool, [1, 2, 3, 4], chain_hash(None, [1, 2, 3, 4]))
    pool.acquire(block)
    assert pool.refcount(block) == 2 and pool.stats().shared == 1 and pool.stats().used == 1
    pool.release([block])
    assert pool.refcount(block) == 1 and pool.stats().shared == 0
    pool.release([block])
    assert pool.stats().used == 0


def test_release_is_in_reverse_order_so_prefix_blocks_are_reused_last():
    pool = BlockPool(SPEC, total_blocks=3, block_tokens=4)
    seq = [_alloc(pool, [i] * 4, chain_hash(None, [i] * 4), start=4 * i) for i in range(3)]
    assert [b.block_id for b in seq] == [0, 1, 2]
    pool.release(seq)
    assert list(pool._cached) == [2, 1, 0]  # the oldest first: the tail
    assert _alloc(pool, [7]).block_id == 2  # the tail block is recycled first
    assert pool.lookup(seq[0].token_hash, [0] * 4) is seq[0]  # the prefix still hits


def test_a_released_registered_block_stays_hittable_until_recycled():
    pool = BlockPool(SPEC, total_blocks=1, block_tokens=4)
    key = chain_hash(None, [1, 2, 3, 4])
    block = _alloc(pool, [1, 2, 3, 4], key)
    pool.release([block])
    assert pool.stats().cached == 1 and pool.stats().free == 1
    assert pool.acquire(pool.lookup(key, [1, 2, 3, 4])) is block
    assert pool.stats().used == 1
    pool.release([block])
    other = _alloc(pool, [5, 6, 7, 8])  # recycles the block: its key is gone
    assert other.block_id == block.block_id and pool.lookup(key, [1, 2, 3, 4]) is None


def test_private_blocks_drop_their_data_when_released():
    pool = BlockPool(SPEC, total_blocks=2, block_tokens=4)
    block = _alloc(pool, [1, 2])
    pool.release([block])
    assert pool.stats().cached == 0 and pool._blocks[block.block_id] is None


def test_pool_arguments_are_validated():
    with pytest.raises(ValueError, match="total_blocks"):
        BlockPool(SPEC, 0)
    with pytest.raises(ValueError, match="block_tokens"):
        BlockPool(SPEC, 1, block_tokens=0)
