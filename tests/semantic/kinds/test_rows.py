"""A row-wise batch keeps each global-attention row in its own K/V buffers: joining, decoding, leaving and
taking drafts back copy nothing, every row decodes what mlx-lm's own greedy generation gives it, and a model
whose code computes with its keys is sent to merged batches by the probe."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

from semantic import BatchExecutor, BlockPool, ModelCacheSpec, Request, cpuattention, kinds
from semantic.cache import room
from semantic.decode import rewind
from semantic.kinds.rows import RowKV, RowsKVCache
from semantic.runner import batchprobe, steploop
from tests.cache_helpers import check
from tests.tiny_models import byte_tokenizer

pytestmark = pytest.mark.compat


def _address(a: mx.array) -> int:
    mx.eval(a)
    return np.asarray(memoryview(a)).__array_interface__["data"][0]


def _cache(n: int, seed: int) -> C.KVCache:
    cache = C.KVCache()
    k = mx.random.normal((1, 2, n, 4), key=mx.random.key(seed))
    cache.update_and_fetch(k, k * 2)
    mx.eval(cache.keys, cache.values)
    return cache


def _held(c: C.KVCache) -> np.ndarray:
    return np.array(c.keys[..., : c.offset, :])


def test_rows_join_decode_take_drafts_back_and_leave_each_in_its_own_buffers():
    a, b, c = _cache(5, 0), _cache(300, 1), _cache(9, 2)
    where = [_address(x.keys) for x in (a, b, c)]
    before = [_held(x) for x in (a, b, c)]
    (batch,) = kinds.merge([[a], [b]], rows=True)
    assert isinstance(batch, RowsKVCache) and batch.offset.tolist() == [5, 300]
    batch.extend(kinds.merge([[c]], rows=True)[0])  # a third row joins: a list grows, nothing is copied
    x = mx.random.normal((3, 2, 3, 4), key=mx.random.key(3))
    keys, values = batch.update_and_fetch(x, x)     # a step of three tokens a row, each into its own spare slots
    assert isinstance(keys, RowKV) and [k.shape[2] for k in keys.rows] == [8, 303, 12]
    assert batch.offset.tolist() == [8, 303, 12]
    batch.rewind([2, 0, 1])                          # each row drops its own rejected drafts: its end moves back
    assert batch.offset.tolist() == [6, 303, 11]
    rows = [batch.extract(i) for i in range(3)]
    assert [r.offset for r in rows] == [6, 303, 11]
    assert [_address(r.keys) for r in rows] == where  # every row still in the buffer it came in
    for r, held, i in zip(rows, before, range(3)):
        n = held.shape[2]
        assert np.array_equal(_held(r)[..., :n, :], held)  # the history, untouched
        assert np.array_equal(_held(r)[..., n:, :], np.array(x[i: i + 1, :, : r.offset - n]))
    batch.filter([2, 0])  # rows leave: the others stay where they are
    assert batch.offset.tolist() == [11, 6] and _address(batch.extract(0).keys) == where[2]


def test_a_row_wise_batch_attends_each_row_over_its_own_keys_as_that_row_alone():
    q = mx.random.normal((2, 4, 1, 4), key=mx.random.key(5))
    a, b = _cache(7, 0), _cache(20, 1)
    keys = RowKV([a.keys[..., :7, :], b.keys[..., :20, :]])
    values = RowKV([a.values[..., :7, :], b.values[..., :20, :]])
    together = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.5) if cpuattention.installed() else None
    alone = [cpuattention.attention(q[i: i + 1], k, v, scale=0.5) for i, (k, v) in enumerate(zip(keys.rows, values.rows))]
    out = cpuattention.attention(q, keys, values, scale=0.5)
    assert out.shape == (2, 4, 1, 4)
    assert np.array_equal(np.array(out), np.array(mx.concatenate(alone, axis=0)))
    if together is not None:
        assert np.array_equal(np.array(together), np.array(out))


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_agents_decoding_together_keep_their_rows_apart_and_get_mlx_lms_greedy_tokens(name, llama_tiny, gemma_tiny,
                                                                                       monkeypatch):
    model = llama_tiny if name == "llama" else gemma_tiny
    spec = ModelCacheSpec.from_model(model)
    executor = BatchExecutor(model, byte_tokenizer(), BlockPool(spec, 512, block_tokens=4), spec,
                             stop_tokens=[], prefill_chunk=8, max_batch=4)
    assert executor.rows_off is None
    monkeypatch.setattr(steploop, "APART_FROM_BYTES", 0)  # every row counts as long: the batch keeps them apart

    def no_merge(*a, **k):
        raise AssertionError("a global-attention row was merged into a batch tensor")

    monkeypatch.setattr(C.BatchKVCache, "merge", classmethod(no_merge))
    seen = []
    step = executor._loop.step

    def watching():
        out = step()
        if executor._loop._batch is not None:
            seen.append(sum(isinstance(c, RowsKVCache) for c in rewind.leaves(executor._loop._batch)))
        return out

    monkeypatch.setattr(executor._loop, "step", watching)
    rng = np.random.default_rng(7)
    prompts = {f"agent-{i}": [int(t) for t in rng.integers(1, 250, n)] for i, n in enumerate((6, 19, 33))}
    for agent, ids in prompts.items():
        executor.submit(Request(agent, ids, 12))
    done = list(executor.step())
    assert len(done) == 3
    for d in done:
        check(model, d)
    globals_ = sum(kinds.of(layer).keeps_rows(layer) for layer in spec.layers)
    assert max(seen) == globals_  # every global layer's batch kept its rows apart


def test_the_probe_sends_a_model_that_computes_with_its_keys_to_merged_batches_which_stay_exact():
    from harness.models import zoo

    cpuattention.install()
    model, _ = zoo.build("stablelm")  # its attention casts the keys it fetched before attending
    spec = ModelCacheSpec.from_model(model)
    why = batchprobe.rows_problem(model, spec)
    assert why is not None and "RowKV" in why
    executor = BatchExecutor(model, byte_tokenizer(), BlockPool(spec, 512, block_tokens=4), spec,
                             stop_tokens=[], prefill_chunk=8, max_batch=4)
    assert executor.rows_off == why
    rng = np.random.default_rng(8)
    for i, n in enumerate((5, 17)):
        executor.submit(Request(f"a{i}", [int(t) for t in rng.integers(1, 250, n)], 6))
    for d in executor.step():
        check(model, d)


def test_a_turn_joining_a_row_wise_batch_is_charged_no_copy_of_the_rows_kept_apart(llama_tiny, gemma_tiny):
    llama = ModelCacheSpec.from_model(llama_tiny)
    assert room.row_bytes(llama, 100, apart=True) == 0 < room.row_bytes(llama, 100)
    gemma = ModelCacheSpec.from_model(gemma_tiny)  # its sliding layers' windows still merge
    windows = sum(layer.bytes_held(100) for layer in gemma.layers if not kinds.of(layer).keeps_rows(layer))
    assert 0 < room.row_bytes(gemma, 100, apart=True) == windows < room.row_bytes(gemma, 100)


def test_a_model_whose_code_stops_the_rows_probe_midway_still_decodes_on_another_thread():
    """gemma3n's KV-shared layers ask the cache for ``keys_and_values`` (0.30.4's unpack its keys): the
    probe's pass stops there, and what the model keeps between passes was left unevaluated, bound to this
    thread (MLX evaluates an array only on the thread that made it): the executor's thread failed on it at
    its first turn."""
    import threading

    from harness.models import zoo

    cpuattention.install()  # as every executor does: the probe asks only where rows can be attended
    model, _ = zoo.build("gemma3n")
    spec = ModelCacheSpec.from_model(model)
    why = batchprobe.rows_problem(model, spec)  # 0.32: no keys_and_values on it; 0.30.4: it unpacks the keys
    assert why is not None and why.startswith("its code fails on row-wise batch caches"), why
    failed = []

    def turn():
        try:
            mx.eval(model(mx.array([[1, 2, 3]]), cache=spec.make_cache()))
        except Exception as exc:  # noqa: BLE001 - reported to the test's thread
            failed.append(exc)

    t = threading.Thread(target=turn)
    t.start()
    t.join(60)
    assert not t.is_alive() and not failed, failed


def test_short_rows_merge_and_a_long_row_joining_them_has_the_batch_kept_apart_with_every_token_exact(llama_tiny,
                                                                                                   monkeypatch):
    """Below ``APART_FROM_BYTES`` a row's merge copy is cheap and one attention for all rows is faster: short
    rows merge. A long row joining them has the short rows copied out and the batch made again, kept apart."""
    spec = ModelCacheSpec.from_model(llama_tiny)
    executor = BatchExecutor(llama_tiny, byte_tokenizer(), BlockPool(spec, 512, block_tokens=4), spec,
                             stop_tokens=[], prefill_chunk=64, max_batch=4)
    per_token = sum(layer.bytes_held(1) for layer in spec.layers)
    monkeypatch.setattr(steploop, "APART_FROM_BYTES", 300 * per_token)  # 300 tokens: the long row's 340 are more
    kept = []
    step = executor._loop.step

    def watching():
        out = step()
        batch = executor._loop._batch
        if batch is not None:
            kept.append((len(executor._loop._rows), isinstance(batch[0], RowsKVCache)))
        return out

    monkeypatch.setattr(executor._loop, "step", watching)
    rng = np.random.default_rng(9)
    shorts = [executor.submit(Request(f"s{i}", [int(t) for t in rng.integers(1, 250, n)], 30)) for i, n in
              enumerate((7, 12))]
    done = []
    for _ in range(100):  # the short rows decode together, merged (a bounded loop: each step is recorded)
        if len(kept) >= 3:
            break
        done += executor.step_once()
    assert len(kept) >= 3 and kept[-1] == (2, False)
    executor.submit(Request("long", [int(t) for t in rng.integers(1, 250, 340)], 8))
    done += list(executor.step())
    assert any(k == (3, True) for k in kept)  # the long row joined: all three kept apart
    assert len(done) == 3 and {d.uid for d in done} >= set(shorts)
    for d in done:
        check(llama_tiny, d)
