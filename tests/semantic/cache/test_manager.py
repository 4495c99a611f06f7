"""The executor's door into the cache: a turn's start, rebuild, extraction and release, on a tiny model."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from semantic import BlockPool, ModelCacheSpec
from semantic import compat
from semantic.cache.manager import CacheManager
from tests.tiny_models import tiny_gemma3, tiny_llama

pytestmark = pytest.mark.compat


def _manager(model, blocks=64):
    spec = ModelCacheSpec.from_model(model)
    return CacheManager(BlockPool(spec, blocks, block_tokens=4), spec, threading.RLock())


def _prefilled(model, spec, ids):
    caches = spec.make_cache()
    model(mx.array([ids]), cache=caches)
    mx.eval([compat.cache_arrays(c) for c in caches])
    return caches


def _extracted(ids):
    """A manager over a tiny llama's pool, the caches of ``ids`` prefilled, and their extracted blocks."""
    model = tiny_llama(seed=3)
    m = _manager(model)
    caches = _prefilled(model, m.spec, ids)
    return m, caches, m.extract(caches, ids, salt_root=None)


def test_an_extracted_cache_is_where_the_next_turn_starts_and_rebuilds_to_the_same_arrays():
    ids = list(range(1, 19))                      # 4 whole blocks of 4 and a tail of 2
    m, caches, blocks = _extracted(ids)
    assert blocks.total_tokens == len(ids)
    start = m.start([*ids, 40, 41], blocks, salt_root=None, share=True)
    assert start.cached == len(ids) and start.blocks is blocks and not start.owned  # its own cache, read
    rebuilt = m.rebuild(blocks)
    for a, b in zip(rebuilt, caches):
        x, y = compat.read_layer(a), compat.read_layer(b)
        assert np.array_equal(np.array(x.keys), np.array(y.keys[..., : len(ids), :]))
    blocks.release()
    assert m.pool.stats().used == 0


def test_another_agent_starts_from_the_pooled_blocks_and_owns_its_references():
    ids = list(range(1, 19))
    m, _, blocks = _extracted(ids)
    start = m.start([*ids[:16], 90, 91, 92], None, salt_root=None, share=True)
    assert (start.cached, start.owned) == (16, True)  # the four whole blocks; the tail is the first agent's
    assert m.start([*ids[:16], 90, 91, 92], None, salt_root=None, share=False).cached == 0  # sharing off
    assert m.start([*ids[:16], 90], None, salt_root=7, share=True).cached == 0  # another tenant's salt
    start.blocks.release()
    blocks.release()
    assert m.pool.stats().used == 0


def test_pooled_is_none_unless_every_block_of_the_prompt_is_in_the_pool():
    ids = list(range(1, 17))
    m, _, blocks = _extracted(ids)
    held = m.pooled(ids)
    assert held is not None and held.total_tokens == 16
    assert m.pooled([*ids[:8], 99, 98, 97, 96]) is None
    held.release()
    blocks.release()


def test_carry_holds_nothing_for_no_positions_and_keep_passed_pools_a_windows_blocks():
    model = tiny_gemma3(seed=5)
    m = _manager(model, blocks=256)
    assert m.carry(list(range(1, 9)), [], salt_root=None) is None
    ids = list(range(1, 33))
    caches = _prefilled(model, m.spec, ids)
    before = m.pool.stats().used
    m.keep_passed(caches, ids, [8, 16], salt_root=None)  # released at once: hittable, not in use
    assert m.pool.stats().used == before
    assert m.start([*ids[:16], 70, 71], None, salt_root=None, share=True).cached == 16
