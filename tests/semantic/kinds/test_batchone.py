"""A batch of one sequence decodes in that sequence's own K/V buffers: no copy when it joins the batch,
none when a decode step writes, none when it leaves; a second row joins, and rows of a batch of two
leave, through mlx-lm's copies."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C
from mlx_lm.models.cache import make_prompt_cache

from semantic import kinds
from semantic.kinds.batchone import WIDEN, BatchOneKVCache
from semantic.request import Request
from semantic.runner.steploop import StepLoop

pytestmark = pytest.mark.compat


def _address(a: mx.array) -> int:
    """Where an evaluated array's data starts (float32 here: numpy reads it through the buffer protocol)."""
    mx.eval(a)
    return np.asarray(memoryview(a)).__array_interface__["data"][0]


def _held(c: C.KVCache) -> np.ndarray:
    return np.array(c.keys[..., : c.offset, :])


def _cache(n: int, seed: int = 0) -> C.KVCache:
    cache = C.KVCache()
    k = mx.random.normal((1, 2, n, 4), key=mx.random.key(seed))
    cache.update_and_fetch(k, k * 2)
    mx.eval(cache.keys, cache.values)
    return cache


def test_one_sequence_joins_and_decodes_in_its_own_buffers():
    cache = _cache(5)
    where = _address(cache.keys)
    (batch,) = kinds.merge([[cache]])
    assert isinstance(batch, BatchOneKVCache) and _address(batch.keys) == where
    del cache  # the sequence's cache object goes once it joins: the batch owns the buffer
    x = mx.random.normal((1, 2, 1, 4), key=mx.random.key(1))
    keys, _ = batch.update_and_fetch(x, x)
    assert _address(batch.keys) == where  # written in place, into a spare slot
    row = batch.extract(0)  # the same buffer: the pool copies what it lacks (cache/test_convert.py)
    assert row.offset == 6 and _address(row.keys) == where
    assert np.array_equal(_held(row)[..., 5:6, :], np.array(x))


def test_a_row_leaves_over_its_own_buffers_and_keeps_its_tokens_while_the_batch_writes_on():
    cache = _cache(1000)  # mlx-lm's 256-slot steps: a buffer of 1024
    where = _address(cache.keys)
    (batch,) = kinds.merge([[cache]])
    del cache
    x = mx.random.normal((1, 2, 1, 4), key=mx.random.key(1))
    batch.update_and_fetch(x, x)
    row = batch.extract(0)  # the same array objects: a turn lent the pool's buffer leaves in it
    assert row.offset == 1001 and _address(row.keys) == where and row.keys is batch.keys
    held = _held(row)
    assert np.array_equal(held[..., 1000:1001, :], np.array(x))
    batch.update_and_fetch(x * 3, x * 3)  # the batch writes on past the row's tokens, which stay
    assert np.array_equal(_held(row), held)


def test_a_batch_of_one_holds_what_mlx_lms_merge_holds():
    cache = _cache(7)
    ours, theirs = BatchOneKVCache.wrap(cache), C.BatchKVCache.merge([cache])
    for name in ("keys", "values"):
        a, b = (getattr(c, name)[..., : c._idx, :] for c in (ours, theirs))
        assert np.array_equal(np.array(a), np.array(b))
    assert ours._idx == theirs._idx and ours.offset.tolist() == theirs.offset.tolist()
    assert ours.left_padding.tolist() == theirs.left_padding.tolist() == [0]
    assert np.array_equal(np.array(ours.make_mask(1)), np.array(theirs.make_mask(1)))


def test_a_second_row_extends_it_and_each_row_comes_out_whole():
    a, b = _cache(5, 0), _cache(9, 1)
    batch = BatchOneKVCache.wrap(a)
    batch.extend(C.BatchKVCache.merge([b]))
    first, second = batch.extract(0), batch.extract(1)
    assert np.array_equal(_held(first), _held(a))
    assert np.array_equal(_held(second), _held(b))


def test_a_lone_turn_equals_the_same_turn_through_mlx_lms_merge(llama_tiny, monkeypatch):
    """The loop's tokens and logprobs are the same bits either way (only where the buffer lives changed),
    and the lone turn did decode in the buffer its prefill left."""
    ids = [int(t) for t in np.random.default_rng(3).integers(1, 250, 19)]

    def run():
        loop = StepLoop(llama_tiny, stop_tokens=[], max_batch=4, prefill_chunk=8)
        caches = make_prompt_cache(llama_tiny)
        loop.add(0, Request("a", ids, 6), 0, caches)
        events = []
        while not events:  # the prefill, to its first token
            events += loop.step()
        where = _address(caches[-1].keys)
        del caches  # the loop's own reference goes when the sequence joins the batch
        events += loop.step()
        moved = _address(loop._batch[-1].keys) != where
        while events[-1].finish_reason is None:
            events += loop.step()
        (closed,) = loop.finish([(0, None)])
        return [e.token for e in events], np.stack([np.array(e.logprobs) for e in events]), closed, moved

    tokens, logprobs, closed, moved = run()
    assert closed.held == len(ids) + 5 and closed.caches[0].offset == closed.held
    assert not moved
    monkeypatch.setattr(BatchOneKVCache, "wrap", classmethod(lambda cls, c: C.BatchKVCache.merge([c])))
    tokens_merged, logprobs_merged, _, moved = run()
    assert moved  # merge copied the row into a new buffer
    assert tokens == tokens_merged
    assert np.array_equal(logprobs, logprobs_merged)


def test_a_lent_row_widens_the_pools_buffer_until_another_row_joins_then_grows_as_mlx_lm_does():
    widened = []

    def widen(keep, slots):  # stands in for ``lending.widen``: what a lent cache carries (cache/test_convert.py)
        widened.append((keep, slots))
        k = mx.concatenate([lent.keys[..., :keep, :], mx.zeros((1, 2, slots - keep + 256, 4))], axis=2)
        return k, k * 2

    lent = _cache(250)  # 256 slots
    setattr(lent, WIDEN, widen)
    (batch,) = kinds.merge([[lent]])
    x = mx.random.normal((1, 2, 10, 4), key=mx.random.key(1))
    batch.update_and_fetch(x, x)  # 260 tokens: widened, not grown by mlx-lm
    assert widened == [(250, 260)] and batch.keys.shape[2] == 516
    batch.extend(kinds.merge([[_cache(3, seed=2)], [_cache(4, seed=3)]])[0])  # a copy of both rows
    y = mx.random.normal((3, 2, 300, 4), key=mx.random.key(4))
    batch.update_and_fetch(y, y)  # past the merged copy's slots: mlx-lm's growth of the copy, no widening
    assert widened == [(250, 260)] and batch.keys.shape[0] == 3
